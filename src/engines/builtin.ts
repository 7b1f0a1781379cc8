/**
 * The registry of every engine built into agentd: `echo` (the default) and the model engines
 * (`openai`, `openai-compat`, `anthropic`). What the daemon and its workers use unless an
 * embedder gives its own registry (`registry({ ...Builtin.engines, mine })`).
 */
import * as Layer from "effect/Layer"
import { Engine, type EngineDefinition, registry } from "../Engine.js"
import * as EchoEngine from "./EchoEngine.js"
import * as ModelEngines from "./ModelEngines.js"

/** Every built-in engine, by name. */
export const engines: Readonly<Record<string, EngineDefinition>> = { ...EchoEngine.engines, ...ModelEngines.engines() }

/** The registry of the built-in engines. */
export const layer: Layer.Layer<Engine> = Layer.succeed(Engine, registry(engines))
