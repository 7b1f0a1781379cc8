/**
 * The one-shot commands of the command line (`status`, `sessions`, `create`, `state`, `log`,
 * `abort`, `retry`, `checkpoint`, `kill`, `shutdown`): one connection, a command or a few, the
 * answer printed as text for people or as one JSON value with `--json`. They run on the plain
 * connection of connection.ts, without Effect (see there why); `prompt` and `attach` follow
 * events over the client SDK (prompt.ts, attach.ts).
 */
import type * as Protocol from "../Protocol.js"
import type { Parsed } from "./args.js"
import { type Connection, withConnection } from "./connection.js"
import { failed, usage } from "./errors.js"
import { alignedTable, count, EventRenderer, shortDate, shortId, summaryLines } from "./render.js"
import { optionValue } from "./engines.js"
import * as Target from "./target.js"
import { readOrCreateToken } from "../internal/http/token.js"
import { stateDirOf } from "./paths.js"
import { web } from "./web.js"

/** What every client command knows. */
export interface Context {
  readonly socketPath: string
  readonly json: boolean
  /** Whether stdout is a terminal that takes colour. */
  readonly color: boolean
  readonly stdoutIsTTY: boolean
}

const out = (s: string) => void process.stdout.write(s.endsWith("\n") ? s : `${s}\n`)

const print = (ctx: Context, value: unknown, text: () => string) => out(ctx.json ? JSON.stringify(value) : text())

/** `f` with the target's session id, resolved on the same connection. */
const withTarget = <A>(ctx: Context, target: string, f: (c: Connection, id: string) => Promise<A>) =>
  withConnection(ctx.socketPath, async (c) => f(c, await Target.resolve(c, target)))

/** What `agentd create` asks for besides a name. */
export interface CreateOptions {
  readonly engine?: string | undefined
  /** `--config`: a JSON object, as typed. */
  readonly config?: string | undefined
  /** `--set KEY=VALUE`, in order. */
  readonly set?: ReadonlyArray<string> | undefined
}

/** The `config` of a create: --config's object, then each --set over it (usage errors: exit 2). */
export const createConfig = (options: CreateOptions): Record<string, unknown> | undefined => {
  let config: Record<string, unknown> | undefined
  if (options.config !== undefined) {
    let parsed: unknown
    try {
      parsed = JSON.parse(options.config)
    } catch (e) {
      throw usage(`--config takes a JSON object: ${(e as Error).message}`)
    }
    if (typeof parsed !== "object" || parsed === null || Array.isArray(parsed)) {
      throw usage(`--config takes a JSON object (got ${Array.isArray(parsed) ? "an array" : parsed === null ? "null" : typeof parsed})`)
    }
    config = { ...parsed as Record<string, unknown> }
  }
  for (const item of options.set ?? []) {
    const eq = item.indexOf("=")
    if (eq <= 0) throw usage(`--set takes KEY=VALUE (got ${JSON.stringify(item)})`)
    const key = item.slice(0, eq)
    // Set as an own data property: a key such as __proto__ must not reach the prototype.
    config ??= {}
    Object.defineProperty(config, key, {
      value: optionValue(options.engine, key, item.slice(eq + 1)),
      enumerable: true,
      writable: true,
      configurable: true
    })
  }
  return config
}

export const create = (ctx: Context, name: string | undefined, options: CreateOptions = {}) =>
  Promise.resolve().then(() => createConfig(options)).then((config) =>
    withConnection(ctx.socketPath, async (c) => {
      // The daemon keeps names unique (name_taken), atomically, and checks the engine and its
      // config: no check here.
      const data = await c.request<Protocol.CreateResult>({
        type: "create",
        ...(name === undefined ? {} : { name }),
        ...(options.engine === undefined ? {} : { engine: options.engine }),
        ...(config === undefined ? {} : { config })
      })
      print(ctx, data, () => data.activeSessionId)
    })
  )

export const rename = (ctx: Context, target: string, name: string) =>
  withTarget(ctx, target, async (c, id) => {
    const s = await c.request<Protocol.SessionSummary>({ type: "rename", activeSessionId: id, name })
    print(ctx, s, () => `renamed ${id} to ${name}`)
  })

export const sessions = (ctx: Context) =>
  withConnection(ctx.socketPath, async (c) => {
    const data = await c.request<Protocol.ListResult>({ type: "list" })
    if (ctx.json) return print(ctx, data, () => "")
    const header = ["NAME", "ID", "WORKER", "BUSY", "MESSAGES", "CREATED", "RESTARTS"]
    if (ctx.stdoutIsTTY) {
      if (data.sessions.length === 0) return out("no sessions (create one with `agentd create`)")
      const rows = data.sessions.map((s) => [
        s.name ?? "-",
        shortId(s.activeSessionId),
        s.worker,
        s.busy ? "yes" : "no",
        String(s.messageCount),
        shortDate(s.createdAt),
        String(s.restarts)
      ])
      return out(alignedTable(header, rows, ctx.color))
    }
    // Piped: tab-separated, whole ids, the header first.
    const rows = data.sessions.map((s) =>
      [s.name ?? "-", s.activeSessionId, s.worker, s.busy ? "yes" : "no", String(s.messageCount), s.createdAt, String(s.restarts)].join("\t")
    )
    out([header.join("\t"), ...rows].join("\n"))
  })

export const status = (ctx: Context) =>
  withConnection(ctx.socketPath, async (c) => {
    const data = await c.request<Protocol.StatusResult>({ type: "status" })
    print(ctx, data, () =>
      `agentd pid ${data.pid}, supervisor generation ${data.supervisorGeneration}, up ${
        Math.round(data.uptimeMs / 1000)
      } s, ${count(data.sessions, "session")}, ${count(data.workers.length, "worker")}\nsocket ${ctx.socketPath}`)
  })

export const state = (ctx: Context, target: string) =>
  withTarget(ctx, target, async (c, id) => {
    const s = await c.request<Protocol.SessionSummary>({ type: "get_state", activeSessionId: id })
    print(ctx, s, () => summaryLines(s))
  })

export const kill = (ctx: Context, target: string) =>
  withTarget(ctx, target, async (c, id) => {
    await c.request({ type: "kill", activeSessionId: id })
    print(ctx, { activeSessionId: id, killed: true }, () => `killed ${id}`)
  })

export const abort = (ctx: Context, target: string) =>
  withTarget(ctx, target, async (c, id) => {
    const r = await c.request<Protocol.AbortResult>({ type: "abort", activeSessionId: id })
    print(ctx, { activeSessionId: id, ...r }, () => (r.aborted ? `aborted the turn of ${id}` : `no turn was running in ${id}`))
  })

export const retry = (ctx: Context, target: string) =>
  withTarget(ctx, target, async (c, id) => {
    const s = await c.request<Protocol.SessionSummary>({ type: "retry_worker", activeSessionId: id })
    print(ctx, s, () => `worker of ${id}: ${s.worker}${s.workerPid === undefined ? "" : ` (pid ${s.workerPid})`}`)
  })

export const checkpoint = (ctx: Context, target: string) =>
  withTarget(ctx, target, async (c, id) => {
    const r = await c.request<Protocol.CheckpointResult>({ type: "checkpoint", activeSessionId: id })
    print(ctx, { activeSessionId: id, ...r }, () => `checkpoint of ${id}: generation ${r.generation} (snapshot ${r.snapshotId})`)
  })

export const shutdown = (ctx: Context) =>
  withConnection(ctx.socketPath, async (c) => {
    await c.request({ type: "shutdown" })
    print(ctx, { shutdown: true }, () => "the daemon is stopping")
  })

/** `get_messages` answers at most this many messages at once. */
const PAGE = 1000

/** Messages `[from, to)` of a session's transcript, page by page, to `each`. */
export const eachMessage = async (
  c: Connection,
  id: string,
  from: number,
  to: number,
  each: (m: Protocol.AgentMessage) => void
): Promise<void> => {
  let offset = from
  while (offset < to) {
    const page = await c.request<Protocol.GetMessagesResult>({
      type: "get_messages",
      activeSessionId: id,
      offset,
      limit: Math.min(PAGE, to - offset)
    })
    if (page.messages.length === 0) break
    for (const m of page.messages) each(m)
    offset += page.messages.length
  }
}

/** `agentd log`: the transcript (or part of it), fetched page by page. */
export const log = (
  ctx: Context,
  target: string,
  range: { readonly tail?: number | undefined; readonly offset?: number | undefined; readonly limit?: number | undefined }
) =>
  withTarget(ctx, target, async (c, id) => {
    const { total } = await c.request<Protocol.GetMessagesResult>({ type: "get_messages", activeSessionId: id, offset: 0, limit: 1 })
    const from = range.tail !== undefined ? Math.max(0, total - range.tail) : Math.min(range.offset ?? 0, total)
    const to = range.limit !== undefined ? Math.min(total, from + range.limit) : total
    if (ctx.json) {
      const messages: Array<Protocol.AgentMessage> = []
      await eachMessage(c, id, from, to, (m) => void messages.push(m))
      return out(JSON.stringify({ activeSessionId: id, total, offset: from, messages }))
    }
    const renderer = new EventRenderer((s) => process.stdout.write(s))
    await eachMessage(c, id, from, to, (m) => renderer.message(m))
  })

/** The one-shot command `p` names, run; undefined for the commands run.ts runs. */
export const runOneShot = (p: Parsed, ctx: Context): Promise<void> | undefined => {
  const target = p.args[0]!
  const int = (name: string) => p.options.get(name) as number | undefined
  switch (p.command.name) {
    case "status":
      return status(ctx)
    case "create":
      return create(ctx, p.options.get("name") as string | undefined, {
        engine: p.options.get("engine") as string | undefined,
        config: p.options.get("config") as string | undefined,
        set: p.options.get("set") as ReadonlyArray<string> | undefined
      })
    case "sessions":
      return sessions(ctx)
    case "log":
      if (int("tail") !== undefined && int("offset") !== undefined) {
        return Promise.reject(usage("--tail and --offset do not go together: --tail N starts N messages before the end"))
      }
      return log(ctx, target, { tail: int("tail"), offset: int("offset"), limit: int("limit") })
    case "state":
      return state(ctx, target)
    case "abort":
      return abort(ctx, target)
    case "retry":
      return retry(ctx, target)
    case "checkpoint":
      return checkpoint(ctx, target)
    case "kill":
      return kill(ctx, target)
    case "rename":
      return rename(ctx, target, p.args[1]!)
    case "shutdown":
      return shutdown(ctx)
    case "http-token":
      return Promise.resolve().then(() => out(readOrCreateToken(stateDirOf(p))))
    case "web":
      return Promise.resolve().then(() =>
        out(web(p.options.get("http") as string | undefined, readOrCreateToken(stateDirOf(p)), p.options.get("print") === true))
      )
    default:
      return undefined
  }
}
