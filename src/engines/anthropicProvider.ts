/**
 * The `anthropic` engine's model: `@effect/ai-anthropic`'s language model (the messages API,
 * `POST {baseUrl}/v1/messages`). Loaded by a worker when a session of the engine starts.
 */
import * as AnthropicClient from "@effect/ai-anthropic/AnthropicClient"
import * as AnthropicLanguageModel from "@effect/ai-anthropic/AnthropicLanguageModel"
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
        AnthropicClient.layer({ apiKey: Option.getOrUndefined(apiKey), apiUrl: config.baseUrl, transformClient }).pipe(
          Layer.provide(FetchHttpClient.layer)
        ),
        scope
      )
      return yield* AnthropicLanguageModel.make({
        model: config.model,
        config: {
          // The messages API requires max_tokens.
          max_tokens: config.maxTokens ?? 4096,
          ...(config.temperature === undefined ? {} : { temperature: Math.min(config.temperature, 1) })
        }
      }).pipe(Effect.provide(client))
    })
}
