/**
 * The engines `agentd serve` has built in (the choices of `--engine`), listed here so that
 * the command line's help does not load the engines' modules. test/cli.test.ts checks it
 * against the daemon's built-in registry (src/engines/builtin.ts), in the same order.
 */
export const builtinEngines: ReadonlyArray<string> = ["echo", "openai", "openai-compat", "anthropic"]
