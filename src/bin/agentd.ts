#!/usr/bin/env node
/**
 * The `agentd` command line (PROTOCOL.md section 8).
 */
import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import * as NodeRuntime from "@effect/platform-node/NodeRuntime"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"

const serve = Command.make("serve", {}, () =>
  Effect.gen(function*() {
    yield* Console.error("agentd serve: the daemon is not built yet (see the open issues)")
    return yield* Effect.sync(() => process.exit(1))
  })).pipe(Command.withDescription("Run the daemon in the foreground."))

const agentd = Command.make("agentd").pipe(
  Command.withDescription("Hosts long-running AI agent sessions in supervised worker processes."),
  Command.withSubcommands([serve])
)

const cli = Command.run(agentd, { name: "agentd", version: "0.1.0" })

cli(process.argv).pipe(Effect.provide(NodeContext.layer), NodeRuntime.runMain)
