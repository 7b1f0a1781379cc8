/**
 * The model engines' (`openai`, `openai-compat`, `anthropic`) per-session configuration and
 * their engine definitions. Light on purpose: the daemon loads this module to validate
 * `create`'s config; the modules that talk to models (`@effect/ai` and the providers) are
 * loaded by a worker only when it starts a session of one of these engines.
 */
import * as Config from "effect/Config"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import * as nodePath from "node:path"
import { type EngineDefinition, EngineError, type EngineSession } from "../Engine.js"
import type * as ModelEngine from "./modelEngine.js"

// ---------------------------------------------------------------------------------------------

/** A model engine's per-session configuration (`create`'s `config`), defaults applied. */
export interface ModelConfig {
  readonly model: string
  readonly baseUrl: string
  readonly temperature: number | undefined
  readonly maxTokens: number | undefined
  readonly system: string | undefined
  /** Rounds of tool calls a turn may make before the model must answer (0: no tools). */
  readonly maxToolRounds: number
  /** The directory the tools work in (absolute); default: the session's work dir. */
  readonly cwd: string | undefined
  /** The environment variable holding the API key. */
  readonly apiKeyEnv: string
  /** Retries of a 429 or 5xx answer before the turn ends with the error. */
  readonly maxRetries: number
  /** The first retry's delay; each next one doubles (a `retry-after` header wins). */
  readonly retryBaseDelayMs: number
  /**
   * The most tokens (estimated: characters / 4) the conversation may hold when a turn starts;
   * past it the older messages are replaced by a summary the model writes. Unset: never.
   */
  readonly maxContextTokens: number | undefined
  /**
   * The longest one HTTP request to the model may take, from its start to its response's last
   * byte (each retry is a request of its own); past it the turn fails with code `timeout`.
   */
  readonly requestTimeoutMs: number
  /**
   * The longest the endpoint may send no byte (before the response's headers, or between two
   * pieces of its body); past it the turn fails with code `timeout`.
   */
  readonly idleTimeoutMs: number
}

/** Defaults an engine takes when a session's config leaves a setting out. */
export interface ModelDefaults {
  readonly model?: string | undefined
  readonly baseUrl?: string | undefined
  readonly temperature?: number | undefined
  readonly maxTokens?: number | undefined
  readonly system?: string | undefined
  readonly maxToolRounds?: number | undefined
  readonly apiKeyEnv?: string | undefined
  readonly maxRetries?: number | undefined
  readonly retryBaseDelayMs?: number | undefined
  readonly maxContextTokens?: number | undefined
  readonly requestTimeoutMs?: number | undefined
  readonly idleTimeoutMs?: number | undefined
}

const CONFIG_KEYS = [
  "model",
  "baseUrl",
  "temperature",
  "maxTokens",
  "system",
  "maxToolRounds",
  "cwd",
  "apiKeyEnv",
  "maxRetries",
  "retryBaseDelayMs",
  "maxContextTokens",
  "requestTimeoutMs",
  "idleTimeoutMs"
] as const

/** The longest `retry-after` the engine waits for; a longer one ends the turn at once. */
export const MAX_RETRY_AFTER_MS = 60_000

/** `requestTimeoutMs` when the config leaves it out: 10 minutes. */
export const DEFAULT_REQUEST_TIMEOUT_MS = 600_000
/** `idleTimeoutMs` when the config leaves it out: 2 minutes. */
export const DEFAULT_IDLE_TIMEOUT_MS = 120_000
/** The largest either timeout may be: a day. */
const MAX_TIMEOUT_MS = 86_400_000

/**
 * Defaults from the configuration provider (the environment unless an embedder provides
 * another): `<PREFIX>_MODEL` and `<PREFIX>_BASE_URL`, e.g. `AGENTD_OPENAI_COMPAT_BASE_URL`.
 */
export const defaultsFromConfig = (prefix: string): Effect.Effect<ModelDefaults> =>
  Config.all({
    model: Config.option(Config.nonEmptyString(`${prefix}_MODEL`)),
    baseUrl: Config.option(Config.nonEmptyString(`${prefix}_BASE_URL`))
  }).pipe(
    Effect.map(({ baseUrl, model }) => ({ model: Option.getOrUndefined(model), baseUrl: Option.getOrUndefined(baseUrl) })),
    // A malformed setting is not this session's fault: it is as good as absent.
    Effect.orElseSucceed(() => ({}))
  )

const invalid = (engine: string, message: string) => new EngineError({ reason: "invalid_config", message: `${engine}: ${message}` })

/** Checks a session's config against the engine's options; unknown keys are refused (typos). */
export const readConfig = (
  engine: string,
  config: Readonly<Record<string, unknown>>,
  defaults: ModelDefaults & { readonly apiKeyEnv: string }
): Effect.Effect<ModelConfig, EngineError> =>
  Effect.suspend(() => {
    for (const key of Object.keys(config)) {
      if (!(CONFIG_KEYS as ReadonlyArray<string>).includes(key)) {
        return Effect.fail(invalid(engine, `unknown option config.${key} (known: ${CONFIG_KEYS.join(", ")})`))
      }
    }
    const str = (key: string, fallback: string | undefined): string | undefined | EngineError => {
      const value = config[key] ?? fallback
      if (value === undefined) return undefined
      return typeof value === "string" && value.length > 0 ? value : invalid(engine, `config.${key} must be a non-empty string`)
    }
    const num = (key: string, fallback: number | undefined, min: number, max: number, integer: boolean): number | undefined | EngineError => {
      const value = config[key] ?? fallback
      if (value === undefined) return undefined
      return typeof value === "number" && Number.isFinite(value) && value >= min && value <= max && (!integer || Number.isInteger(value))
        ? value
        : invalid(engine, `config.${key} must be ${integer ? "an integer" : "a number"} from ${min} to ${max}`)
    }
    const model = str("model", defaults.model)
    const baseUrl = str("baseUrl", defaults.baseUrl)
    const system = str("system", defaults.system)
    const cwd = str("cwd", undefined)
    const apiKeyEnv = str("apiKeyEnv", defaults.apiKeyEnv)
    const temperature = num("temperature", defaults.temperature, 0, 2, false)
    const maxTokens = num("maxTokens", defaults.maxTokens, 1, 10_000_000, true)
    const maxToolRounds = num("maxToolRounds", defaults.maxToolRounds ?? 8, 0, 1000, true)
    const maxRetries = num("maxRetries", defaults.maxRetries ?? 3, 0, 20, true)
    const retryBaseDelayMs = num("retryBaseDelayMs", defaults.retryBaseDelayMs ?? 500, 0, MAX_RETRY_AFTER_MS, true)
    const maxContextTokens = num("maxContextTokens", defaults.maxContextTokens, 100, 100_000_000, true)
    const requestTimeoutMs = num("requestTimeoutMs", defaults.requestTimeoutMs ?? DEFAULT_REQUEST_TIMEOUT_MS, 1, MAX_TIMEOUT_MS, true)
    const idleTimeoutMs = num("idleTimeoutMs", defaults.idleTimeoutMs ?? DEFAULT_IDLE_TIMEOUT_MS, 1, MAX_TIMEOUT_MS, true)
    for (
      const v of [
        model,
        baseUrl,
        system,
        cwd,
        apiKeyEnv,
        temperature,
        maxTokens,
        maxToolRounds,
        maxRetries,
        retryBaseDelayMs,
        maxContextTokens,
        requestTimeoutMs,
        idleTimeoutMs
      ]
    ) {
      if (v instanceof EngineError) return Effect.fail(v)
    }
    if (model === undefined) return Effect.fail(invalid(engine, "config.model is required (the model's name)"))
    if (baseUrl === undefined) return Effect.fail(invalid(engine, "config.baseUrl is required (e.g. http://127.0.0.1:8080/v1)"))
    let url: URL
    try {
      url = new URL(baseUrl as string)
    } catch {
      return Effect.fail(invalid(engine, `config.baseUrl is not a URL: ${baseUrl as string}`))
    }
    if (url.protocol !== "http:" && url.protocol !== "https:") {
      return Effect.fail(invalid(engine, "config.baseUrl must be an http or https URL"))
    }
    if (url.username !== "" || url.password !== "") {
      return Effect.fail(invalid(engine, "config.baseUrl must not carry credentials (the API key comes from the environment)"))
    }
    if (cwd !== undefined && !nodePath.isAbsolute(cwd as string)) {
      return Effect.fail(invalid(engine, "config.cwd must be an absolute path"))
    }
    if (!/^[A-Za-z_][A-Za-z0-9_]*$/.test(apiKeyEnv as string)) {
      return Effect.fail(invalid(engine, "config.apiKeyEnv must be an environment variable's name"))
    }
    return Effect.succeed({
      model: model as string,
      baseUrl: (baseUrl as string).replace(/\/+$/, ""),
      temperature: temperature as number | undefined,
      maxTokens: maxTokens as number | undefined,
      system: system as string | undefined,
      maxToolRounds: maxToolRounds as number,
      cwd: cwd as string | undefined,
      apiKeyEnv: apiKeyEnv as string,
      maxRetries: maxRetries as number,
      retryBaseDelayMs: retryBaseDelayMs as number,
      maxContextTokens: maxContextTokens as number | undefined,
      requestTimeoutMs: requestTimeoutMs as number,
      idleTimeoutMs: idleTimeoutMs as number
    })
  })

// ---------------------------------------------------------------------------------------------
// Engine definitions
// ---------------------------------------------------------------------------------------------

/**
 * An engine definition over a provider. `defaults` are the embedder's; settings missing from
 * the session's config and from them come from the configuration provider
 * (`<configPrefix>_MODEL`, `<configPrefix>_BASE_URL`), then from `builtInDefaults`. The
 * provider (and `@effect/ai`) is loaded only when a session starts.
 */
export const definition = (options: {
  readonly engine: string
  readonly apiKeyEnv: string
  readonly configPrefix: string
  readonly builtInDefaults?: ModelDefaults | undefined
  readonly defaults?: ModelDefaults | undefined
  readonly provider: () => Promise<ModelEngine.ModelProvider>
}): EngineDefinition => {
  const read = (config: Readonly<Record<string, unknown>>) =>
    Effect.flatMap(defaultsFromConfig(options.configPrefix), (fromEnv) =>
      readConfig(options.engine, config, {
        ...withoutUndefined(options.builtInDefaults),
        ...withoutUndefined(fromEnv),
        ...withoutUndefined(options.defaults),
        apiKeyEnv: options.defaults?.apiKeyEnv ?? options.apiKeyEnv
      }))
  return {
    validate: (config) => Effect.asVoid(read(config)),
    make: (config) =>
      Effect.gen(function*() {
        const modelConfig = yield* read(config)
        const [engine, provider] = yield* Effect.tryPromise({
          try: () => Promise.all([import("./modelEngine.js"), options.provider()]),
          catch: (e) => new EngineError({ reason: "invalid_config", message: `${options.engine}: the engine cannot be loaded: ${String(e)}` })
        })
        return yield* engine.start(options.engine, modelConfig, provider) as Effect.Effect<EngineSession, EngineError>
      })
  }
}

const withoutUndefined = <A extends object>(a: A | undefined): Partial<A> =>
  a === undefined ? {} : Object.fromEntries(Object.entries(a).filter(([, v]) => v !== undefined)) as Partial<A>
