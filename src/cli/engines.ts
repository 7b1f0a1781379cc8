/**
 * The engines `agentd serve` has built in (the choices of `--engine`), listed here so that
 * the command line's help does not load the engines' modules. test/cli.test.ts checks it
 * against the daemon's built-in registry (src/engines/builtin.ts), in the same order.
 */
export const builtinEngines: ReadonlyArray<string> = ["echo", "openai", "openai-compat", "anthropic"]

/** The type of a config option's value: how `agentd create --set KEY=VALUE` reads VALUE. */
export type OptionType = "number" | "string" | "boolean"

const modelOptions: Readonly<Record<string, OptionType>> = {
  model: "string",
  baseUrl: "string",
  temperature: "number",
  maxTokens: "number",
  system: "string",
  maxToolRounds: "number",
  cwd: "string",
  apiKeyEnv: "string",
  maxRetries: "number",
  retryBaseDelayMs: "number",
  maxContextTokens: "number",
  requestTimeoutMs: "number",
  idleTimeoutMs: "number"
}

/**
 * Each built-in engine's config options and their types (test/cli.test.ts checks them against
 * the engines' own lists), for `--set`: a value is read by its option's type, so `--set
 * model=1234` stays a string and `--set tokenDelayMs=5` is a number.
 */
export const engineOptions: Readonly<Record<string, Readonly<Record<string, OptionType>>>> = {
  echo: { tokenDelayMs: "number" },
  openai: modelOptions,
  "openai-compat": modelOptions,
  anthropic: modelOptions
}

/**
 * VALUE of `--set KEY=VALUE` as the engine's option KEY takes it. A value that does not read as
 * its type (or an option this table does not know: an embedder's engine, a typo) is read as JSON
 * when it is a number, `true`, `false` or `null`, else kept as text: the daemon judges it and
 * names the option in its refusal.
 */
export const optionValue = (engine: string | undefined, key: string, value: string): unknown => {
  // Without --engine the daemon's default engine applies, unknown here: an option has the same
  // type in every built-in engine that has it.
  const type = engine === undefined
    ? Object.values(engineOptions).find((options) => options[key] !== undefined)?.[key]
    : engineOptions[engine]?.[key]
  const number = /^-?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(value)
  if (type === "string") return value
  if (type === "boolean" && (value === "true" || value === "false")) return value === "true"
  if (number) return Number(value)
  if (value === "true" || value === "false") return value === "true"
  if (value === "null") return null
  return value
}
