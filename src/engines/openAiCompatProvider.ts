/**
 * The `openai-compat` engine's model: the chat-completions `LanguageModel` of OpenAiCompat.ts.
 * Loaded by a worker when a session of the engine starts.
 */
import * as FetchHttpClient from "@effect/platform/FetchHttpClient"
import * as Effect from "effect/Effect"
import * as Option from "effect/Option"
import type { ModelProvider } from "./modelEngine.js"
import * as OpenAiCompat from "./OpenAiCompat.js"

export const provider: ModelProvider = {
  make: ({ apiKey, config, transformClient }) =>
    OpenAiCompat.make({
      baseUrl: config.baseUrl,
      model: config.model,
      apiKey: Option.getOrUndefined(apiKey),
      temperature: config.temperature,
      maxTokens: config.maxTokens,
      transformClient
    }).pipe(Effect.provide(FetchHttpClient.layer))
}
