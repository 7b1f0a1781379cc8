#!/usr/bin/env node
/**
 * The `agentd` command line (PROTOCOL.md section 8). Exit codes: 0 success, 1 error reported by
 * the daemon (for `prompt`: also a turn that ended with `turn_interrupted`), 2 usage error,
 * 3 daemon not reachable (or gone while a command waited).
 */
import * as Args from "@effect/cli/Args"
import * as Command from "@effect/cli/Command"
import * as Options from "@effect/cli/Options"
import * as ValidationError from "@effect/cli/ValidationError"
import * as NodeContext from "@effect/platform-node/NodeContext"
import * as NodeRuntime from "@effect/platform-node/NodeRuntime"
import * as Effect from "effect/Effect"
import * as Logger from "effect/Logger"
import * as Option from "effect/Option"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import * as Daemon from "../Daemon.js"
import * as DaemonConfig from "../DaemonConfig.js"
import * as Client from "./client.js"

const stateDir = Options.directory("state-dir").pipe(
  Options.withDescription("State directory (default $AGENTD_HOME, $XDG_STATE_HOME/agentd or ~/.local/state/agentd)."),
  Options.optional
)
const socket = Options.text("socket").pipe(
  Options.withDescription("Socket path (default $AGENTD_SOCKET, else <state-dir>/agentd.sock)."),
  Options.optional
)
const json = Options.boolean("json").pipe(Options.withDescription("Machine output (JSON)."))

const socketPathOf = (dir: Option.Option<string>, sock: Option.Option<string>) => {
  const state = Option.getOrElse(dir, () => DaemonConfig.defaultStateDir())
  return DaemonConfig.resolveSocketPath(path.resolve(state), Option.getOrUndefined(sock))
}

const serve = Command.make(
  "serve",
  {
    stateDir,
    socket,
    engine: Options.text("engine").pipe(Options.withDescription("Default engine of new sessions (echo)."), Options.optional),
    maxWorkers: Options.integer("max-workers").pipe(
      Options.withDescription("Live worker processes beyond which idle sessions are passivated (32)."),
      Options.optional
    )
  },
  (opts) =>
    Effect.gen(function*() {
      const dir = path.resolve(Option.getOrElse(opts.stateDir, () => DaemonConfig.defaultStateDir()))
      yield* Daemon.serve({
        stateDir: dir,
        socketPath: DaemonConfig.resolveSocketPath(dir, Option.getOrUndefined(opts.socket)),
        // Next to this file, whether it is the compiled module or the bundle (see package.json).
        workerEntry: fileURLToPath(new URL("./worker.js", import.meta.url)),
        ...Option.match(opts.engine, { onNone: () => ({}), onSome: (engine) => ({ engine }) }),
        ...Option.match(opts.maxWorkers, { onNone: () => ({}), onSome: (maxWorkers) => ({ maxWorkers }) })
      }).pipe(
        // The daemon logs to stderr (section 8); stdout stays free.
        Effect.provide(Logger.replace(Logger.defaultLogger, Logger.prettyLogger({ stderr: true, colors: false })))
      )
    })
).pipe(Command.withDescription("Run the daemon in the foreground (logs to stderr)."))

const common = { stateDir, socket, json }

const create = Command.make("create", { ...common, name: Options.text("name").pipe(Options.optional) }, (o) =>
  Client.create(socketPathOf(o.stateDir, o.socket), Option.getOrUndefined(o.name), o.json)).pipe(
    Command.withDescription("Create a session and print its activeSessionId.")
  )

const sessions = Command.make("sessions", common, (o) => Client.sessions(socketPathOf(o.stateDir, o.socket), o.json)).pipe(
  Command.withDescription("List the sessions.")
)

const status = Command.make("status", common, (o) => Client.status(socketPathOf(o.stateDir, o.socket), o.json)).pipe(
  Command.withDescription("Show the daemon's status.")
)

const sessionId = Args.text({ name: "ID" }).pipe(Args.withDescription("The session's activeSessionId."))

const prompt = Command.make(
  "prompt",
  { ...common, id: sessionId, text: Args.text({ name: "TEXT" }) },
  (o) => Client.prompt(socketPathOf(o.stateDir, o.socket), o.id, o.text, o.json)
).pipe(Command.withDescription("Send a prompt and stream the reply until the turn ends."))

const attach = Command.make("attach", { ...common, id: sessionId }, (o) =>
  Client.attach(socketPathOf(o.stateDir, o.socket), o.id, o.json)).pipe(
    Command.withDescription("Follow a session's events, reconnecting and resuming by cursor.")
  )

const kill = Command.make("kill", { stateDir, socket, id: sessionId }, (o) =>
  Client.kill(socketPathOf(o.stateDir, o.socket), o.id)).pipe(
    Command.withDescription("Kill a session (its files move to the archive).")
  )

const shutdown = Command.make("shutdown", { stateDir, socket }, (o) =>
  Client.shutdown(socketPathOf(o.stateDir, o.socket))).pipe(
    Command.withDescription("Stop the daemon.")
  )

const agentd = Command.make("agentd").pipe(
  Command.withDescription("Hosts long-running AI agent sessions in supervised worker processes."),
  Command.withSubcommands([serve, create, sessions, status, prompt, attach, kill, shutdown])
)

const cli = Command.run(agentd, { name: "agentd", version: "0.1.0" })

cli(process.argv).pipe(
  Effect.catchAll((error) =>
    Effect.sync(() => {
      if (typeof error === "object" && error !== null && "_tag" in error) {
        if (error._tag === "DaemonUnreachable" || error._tag === "DaemonDisconnected") {
          console.error(`agentd: ${(error as unknown as { message: string }).message}`)
          process.exitCode = 3
          return
        }
        if (
          error._tag === "DaemonError" || error._tag === "ProtocolMismatch" || error._tag === "InvalidResponse" ||
          error._tag === "TurnInterrupted" || error._tag === "SessionClosedError"
        ) {
          console.error(`agentd: ${(error as unknown as { message: string }).message}`)
          process.exitCode = 1
          return
        }
        if (error._tag === "ServerStartError" || error._tag === "FsError") {
          console.error(`agentd: ${(error as unknown as { message: string }).message}`)
          process.exitCode = 1
          return
        }
        if (error._tag === "EngineError") {
          // `serve --engine` naming an engine that does not exist: a usage error.
          console.error(`agentd: ${(error as unknown as { message: string }).message}`)
          process.exitCode = 2
          return
        }
      }
      if (ValidationError.isValidationError(error)) {
        // @effect/cli has already printed what was wrong with the command line.
        process.exitCode = 2
        return
      }
      console.error(`agentd: ${error instanceof Error ? error.message : String(error)}`)
      process.exitCode = 1
    })
  ),
  Effect.provide(NodeContext.layer),
  NodeRuntime.runMain({ disableErrorReporting: false, disablePrettyLogger: true })
)
