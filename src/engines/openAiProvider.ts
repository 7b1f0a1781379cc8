/**
 * The `openai` engine's model: `@effect/ai-openai`'s language model (OpenAI's Responses API,
 * `POST {baseUrl}/responses`). Loaded by a worker when a session of the engine starts.
 */
import * as OpenAiClient from "@effect/ai-openai/OpenAiClient"
import * as OpenAiLanguageModel from "@effect/ai-openai/OpenAiLanguageModel"
import * as FetchHttpClient from "@effect/platform/FetchHttpClient"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import type { ModelProvider } from "./modelEngine.js"

export const provider: ModelProvider = {
  make: ({ apiKey, config, transformClient }) =>
    Effect.gen(function*() {
      // The session's model lives as long as its worker: its scope is never closed.
      const scope = yield* Scope.make()
      const client = yield* Layer.buildWithScope(
        OpenAiClient.layer({ apiKey: Option.getOrUndefined(apiKey), apiUrl: config.baseUrl, transformClient }).pipe(
          Layer.provide(FetchHttpClient.layer)
        ),
        scope
      )
      return yield* OpenAiLanguageModel.make({
        model: config.model,
        config: {
          ...(config.temperature === undefined ? {} : { temperature: config.temperature }),
          ...(config.maxTokens === undefined ? {} : { max_output_tokens: config.maxTokens }),
          // The built-in tools' schemas are strict-compatible; a server that implements the
          // Responses API without structured outputs still accepts them.
          strict: true
        }
      }).pipe(Effect.provide(client))
    })
}
