/**
 * The client commands of the command line (all but `serve`, `logs` and `attach`), over the
 * client SDK (`DaemonClient`). Each prints text for people, or one JSON value with `--json`.
 */
import * as Deferred from "effect/Deferred"
import * as Duration from "effect/Duration"
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Schedule from "effect/Schedule"
import * as Stream from "effect/Stream"
import * as fs from "node:fs"
import * as DaemonClient from "../DaemonClient.js"
import type * as Protocol from "../Protocol.js"
import { CliError, EXIT, failed, usage } from "./errors.js"
import { alignedTable, EventRenderer, shortDate, shortId, summaryLines } from "./render.js"
import * as Target from "./target.js"

/** What every client command knows. */
export interface Context {
  readonly socketPath: string
  readonly json: boolean
  /** Whether stdout is a terminal that takes colour. */
  readonly color: boolean
  readonly stdoutIsTTY: boolean
}

export const withClient = <A, E>(
  ctx: Context,
  f: (c: DaemonClient.DaemonClientService) => Effect.Effect<A, E>
) => Effect.scoped(Effect.flatMap(DaemonClient.make({ socketPath: ctx.socketPath }), f))

const out = (s: string) => Effect.sync(() => process.stdout.write(s.endsWith("\n") ? s : `${s}\n`))

const print = (ctx: Context, value: unknown, text: () => string) => out(ctx.json ? JSON.stringify(value) : text())

/** The target's session, resolved on this connection. */
const withTarget = <A, E>(
  ctx: Context,
  target: string,
  f: (c: DaemonClient.DaemonClientService, id: string) => Effect.Effect<A, E>
) => withClient(ctx, (c) => Effect.flatMap(Target.resolve(c, target), (id) => f(c, id)))

export const create = (ctx: Context, name: string | undefined) =>
  withClient(ctx, (c) =>
    Effect.gen(function*() {
      if (name !== undefined) {
        // The daemon lets names repeat; the command line keeps them unique so that they can be
        // targets (a check, then the create: two racing creates can still share a name).
        const { sessions } = yield* c.list()
        const taken = sessions.find((s) => s.name === name)
        if (taken !== undefined) return yield* failed(`the name ${JSON.stringify(name)} is in use by ${taken.activeSessionId}`)
      }
      const data = yield* c.create(name === undefined ? {} : { name })
      yield* print(ctx, data, () => data.activeSessionId)
    }))

export const sessions = (ctx: Context) =>
  withClient(ctx, (c) =>
    Effect.gen(function*() {
      const data = yield* c.list()
      if (ctx.json) return yield* print(ctx, data, () => "")
      const header = ["NAME", "ID", "WORKER", "BUSY", "MESSAGES", "CREATED", "RESTARTS"]
      if (ctx.stdoutIsTTY) {
        if (data.sessions.length === 0) return yield* out("no sessions (create one with `agentd create`)")
        const rows = data.sessions.map((s) => [
          s.name ?? "-",
          shortId(s.activeSessionId),
          s.worker,
          s.busy ? "yes" : "no",
          String(s.messageCount),
          shortDate(s.createdAt),
          String(s.restarts)
        ])
        return yield* out(alignedTable(header, rows, ctx.color))
      }
      // Piped: tab-separated, whole ids, the header first.
      const rows = data.sessions.map((s) =>
        [s.name ?? "-", s.activeSessionId, s.worker, s.busy ? "yes" : "no", String(s.messageCount), s.createdAt, String(s.restarts)].join("\t")
      )
      yield* out([header.join("\t"), ...rows].join("\n"))
    }))

export const status = (ctx: Context) =>
  withClient(ctx, (c) =>
    Effect.gen(function*() {
      const data = yield* c.status()
      yield* print(ctx, data, () =>
        `agentd pid ${data.pid}, supervisor generation ${data.supervisorGeneration}, up ${
          Math.round(data.uptimeMs / 1000)
        } s, ${data.sessions} sessions, ${data.workers.length} workers\nsocket ${ctx.socketPath}`)
    }))

export const state = (ctx: Context, target: string) =>
  withTarget(ctx, target, (c, id) => Effect.flatMap(c.getState(id), (s) => print(ctx, s, () => summaryLines(s))))

export const kill = (ctx: Context, target: string) =>
  withTarget(ctx, target, (c, id) => Effect.zipRight(c.kill(id), print(ctx, { activeSessionId: id, killed: true }, () => `killed ${id}`)))

export const abort = (ctx: Context, target: string) =>
  withTarget(ctx, target, (c, id) =>
    Effect.flatMap(c.abort(id), (r) =>
      print(ctx, { activeSessionId: id, ...r }, () => (r.aborted ? `aborted the turn of ${id}` : `no turn was running in ${id}`))))

export const retry = (ctx: Context, target: string) =>
  withTarget(ctx, target, (c, id) =>
    Effect.flatMap(c.retryWorker(id), (s) => print(ctx, s, () => `worker of ${id}: ${s.worker}${s.workerPid === undefined ? "" : ` (pid ${s.workerPid})`}`)))

export const checkpoint = (ctx: Context, target: string) =>
  withTarget(ctx, target, (c, id) =>
    Effect.flatMap(c.checkpoint(id), (r) =>
      print(ctx, { activeSessionId: id, ...r }, () => `checkpoint of ${id}: generation ${r.generation} (snapshot ${r.snapshotId})`)))

export const shutdown = (ctx: Context) =>
  withClient(ctx, (c) => Effect.zipRight(c.shutdown(), print(ctx, { shutdown: true }, () => "the daemon is stopping")))

/** `get_messages` answers at most this many messages at once. */
const PAGE = 1000

/** Messages `[from, to)` of a session's transcript, page by page, to `each`. */
export const eachMessage = <E>(
  c: DaemonClient.DaemonClientService,
  id: string,
  from: number,
  to: number,
  each: (m: Protocol.AgentMessage) => Effect.Effect<void, E>
) =>
  Effect.gen(function*() {
    let offset = from
    while (offset < to) {
      const page = yield* c.getMessages(id, { offset, limit: Math.min(PAGE, to - offset) })
      if (page.messages.length === 0) break
      for (const m of page.messages) yield* each(m)
      offset += page.messages.length
    }
  })

/** `agentd log`: the transcript (or part of it), fetched page by page. */
export const log = (
  ctx: Context,
  target: string,
  range: { readonly tail?: number | undefined; readonly offset?: number | undefined; readonly limit?: number | undefined }
) =>
  withTarget(ctx, target, (c, id) =>
    Effect.gen(function*() {
      const { total } = yield* c.getMessages(id, { offset: 0, limit: 1 })
      const from = range.tail !== undefined ? Math.max(0, total - range.tail) : Math.min(range.offset ?? 0, total)
      const to = range.limit !== undefined ? Math.min(total, from + range.limit) : total
      if (ctx.json) {
        const messages: Array<Protocol.AgentMessage> = []
        yield* eachMessage(c, id, from, to, (m) => Effect.sync(() => void messages.push(m)))
        return yield* out(JSON.stringify({ activeSessionId: id, total, offset: from, messages }))
      }
      const renderer = new EventRenderer((s) => process.stdout.write(s))
      yield* eachMessage(c, id, from, to, (m) => Effect.sync(() => renderer.message(m)))
    }))

/** Reads a whole stream (stdin) as UTF-8. */
const readAll = (stream: NodeJS.ReadableStream): Effect.Effect<string, CliError> =>
  Effect.async<string, CliError>((resume) => {
    const chunks: Array<Buffer> = []
    const onData = (b: Buffer) => chunks.push(b)
    const onEnd = () => resume(Effect.succeed(Buffer.concat(chunks).toString("utf8")))
    const onError = (e: Error) => resume(Effect.fail(failed(`cannot read the prompt from stdin: ${e.message}`)))
    stream.on("data", onData)
    stream.once("end", onEnd)
    stream.once("error", onError)
    return Effect.sync(() => {
      stream.off("data", onData)
      stream.off("end", onEnd)
      stream.off("error", onError)
    })
  })

/** The prompt's text: the argument, stdin (`-`), or `--file` (`-` for stdin too). */
export const promptText = (text: string | undefined, file: string | undefined): Effect.Effect<string, CliError> => {
  if (text !== undefined && file !== undefined) return Effect.fail(usage("give the prompt as TEXT or with --file, not both"))
  const source = file ?? text
  if (source === undefined) return Effect.fail(usage("missing TEXT (or `-` to read it from stdin, or --file PATH)"))
  if (file === undefined && text !== "-") return Effect.succeed(source)
  if (source === "-") {
    if (process.stdin.isTTY === true) process.stderr.write("agentd: reading the prompt from stdin (end it with Ctrl-D)\n")
    return Effect.map(readAll(process.stdin), withoutFinalNewline)
  }
  return Effect.try({
    try: () => withoutFinalNewline(fs.readFileSync(source, "utf8")),
    catch: (e) => failed(`cannot read ${source}: ${(e as NodeJS.ErrnoException).code ?? String(e)}`)
  })
}

/** A text read from a file or a pipe loses one final newline (as `$(...)` in a shell would). */
const withoutFinalNewline = (s: string): string => s.replace(/\r?\n$/, "")

/** How long `prompt` waits, after Ctrl-C, for its turn to end once aborted. */
const ABORT_WAIT = Duration.seconds(10)

/**
 * `agentd prompt`: sends the prompt and streams the assistant's reply to stdout until the turn
 * ends. A turn that ends with `turn_interrupted` is an error (exit 1, the reason on stderr).
 * Ctrl-C aborts the turn (`abort`, repeated until the daemon says it aborted one or the turn
 * ends), waits for its end, and exits 130; a second Ctrl-C exits 130 at once.
 */
export const prompt = (ctx: Context, target: string, message: string) =>
  withTarget(ctx, target, (c, id) =>
    Effect.scoped(Effect.gen(function*() {
      const sigint = yield* Deferred.make<void>()
      let signals = 0
      const onSigint = () => {
        if (++signals > 1) process.exit(EXIT.interrupted)
        Deferred.unsafeDone(sigint, Effect.void)
      }
      yield* Effect.acquireRelease(
        Effect.sync(() => process.on("SIGINT", onSigint)),
        () => Effect.sync(() => process.off("SIGINT", onSigint))
      )
      const roles = new Map<string, string>()
      let wrote = false
      const turn = c.promptTurn(id, message).pipe(
        Stream.runForEach((m) =>
          Effect.sync(() => {
            if (ctx.json) {
              process.stdout.write(JSON.stringify(m) + "\n")
              return
            }
            const e = m.event
            if (e.type === "message_start") roles.set(e.message.id, e.message.role)
            else if (e.type === "message_update" && (roles.get(e.messageId) ?? "assistant") === "assistant") {
              process.stdout.write(e.delta)
              wrote = true
            }
          })
        ),
        Effect.ensuring(Effect.sync(() => {
          if (!ctx.json && wrote) process.stdout.write("\n")
        }))
      )
      const running = yield* Effect.fork(Effect.either(turn))
      const first = yield* Effect.raceFirst(
        Effect.map(Fiber.join(running), Option.some),
        Effect.as(Deferred.await(sigint), Option.none())
      )
      if (Option.isSome(first)) {
        // The turn ended before any Ctrl-C.
        if (Either.isLeft(first.value)) return yield* first.value.left
        return
      }
      // Ctrl-C: abort the turn (until the daemon says it aborted one: the prompt may still
      // wait for a worker), then wait for the turn's end.
      const aborting = yield* Effect.fork(
        c.abort(id).pipe(
          Effect.repeat({ until: (r) => r.aborted, schedule: Schedule.spaced("100 millis") }),
          Effect.ignore
        )
      )
      const ended = yield* Fiber.join(running).pipe(Effect.timeout(ABORT_WAIT), Effect.option)
      yield* Fiber.interrupt(aborting)
      const how = Option.match(ended, {
        onNone: () => `the turn did not end within ${Duration.format(ABORT_WAIT)} of the abort`,
        onSome: (r) =>
          Either.isLeft(r) && r.left._tag === "TurnInterrupted"
            ? `the turn was aborted`
            : Either.isRight(r)
            ? `the turn had ended`
            : `the turn's end was not seen (${r.left.message})`
      })
      return yield* new CliError({ message: `interrupted (Ctrl-C): ${how}`, exitCode: EXIT.interrupted })
    })))
