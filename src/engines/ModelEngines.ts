/**
 * The model engines built into agentd:
 * - `openai`: OpenAI through `@effect/ai-openai` (the Responses API); key `OPENAI_API_KEY`.
 * - `openai-compat`: any chat-completions endpoint (llama.cpp, vLLM, Ollama, ...), through the
 *   small `LanguageModel` of OpenAiCompat.ts; key `OPENAI_API_KEY` (if the server wants one).
 * - `anthropic`: Anthropic's messages API through `@effect/ai-anthropic`; key `ANTHROPIC_API_KEY`.
 *
 * Each takes `model`, `baseUrl`, `temperature`, `maxTokens`, `system`, `maxToolRounds`, `cwd`,
 * `apiKeyEnv`, `maxRetries`, `retryBaseDelayMs`, `maxContextTokens`, `requestTimeoutMs` and `idleTimeoutMs` in
 * `create`'s `config` (modelConfig.ts);
 * the defaults of `model` and `baseUrl` may come from `AGENTD_<ENGINE>_MODEL` and
 * `AGENTD_<ENGINE>_BASE_URL` (`AGENTD_OPENAI_*`, `AGENTD_OPENAI_COMPAT_*`, `AGENTD_ANTHROPIC_*`).
 * An embedder gives its own defaults with `engines({ openai: { model: ... } })`.
 */
import type { EngineDefinition } from "../Engine.js"
import { definition, type ModelDefaults } from "./modelConfig.js"

/** The model engines' definitions, with an embedder's defaults per engine. */
export const engines = (defaults: {
  readonly openai?: ModelDefaults
  readonly "openai-compat"?: ModelDefaults
  readonly anthropic?: ModelDefaults
} = {}): Readonly<Record<string, EngineDefinition>> => ({
  openai: definition({
    engine: "openai",
    apiKeyEnv: "OPENAI_API_KEY",
    configPrefix: "AGENTD_OPENAI",
    builtInDefaults: { baseUrl: "https://api.openai.com/v1" },
    defaults: defaults.openai,
    provider: () => import("./openAiProvider.js").then((m) => m.provider)
  }),
  "openai-compat": definition({
    engine: "openai-compat",
    apiKeyEnv: "OPENAI_API_KEY",
    configPrefix: "AGENTD_OPENAI_COMPAT",
    defaults: defaults["openai-compat"],
    provider: () => import("./openAiCompatProvider.js").then((m) => m.provider)
  }),
  anthropic: definition({
    engine: "anthropic",
    apiKeyEnv: "ANTHROPIC_API_KEY",
    configPrefix: "AGENTD_ANTHROPIC",
    builtInDefaults: { baseUrl: "https://api.anthropic.com" },
    defaults: defaults.anthropic,
    provider: () => import("./anthropicProvider.js").then((m) => m.provider)
  })
})
