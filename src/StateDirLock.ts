/**
 * One daemon per state dir (docs/protocol.md sections 6 and 9): an exclusive lock on the state
 * dir, taken before anything is written there and held for the daemon's whole life.
 *
 * The lock is a Linux abstract-namespace Unix socket whose name is derived from the user id and
 * a hash of the state dir's real path (so a symlink, a relative path or a trailing slash name
 * the same lock). Binding a name that is bound fails with `EADDRINUSE`, atomically, and the
 * kernel frees the name when the socket's last holder dies, however it dies: a daemon killed
 * with SIGKILL leaves no stale lock to guess about, and no file at all. The holder answers
 * every connection on it with one JSON line, `{pid, socketPath, stateDir}`, which is how a
 * refused daemon names it. Why this rather than `flock(2)`: it needs no native addon (Node has
 * no flock), so installing agentd needs no compiler. Its limits: a name is per network
 * namespace (two daemons in different network namespaces sharing a state dir are not seen) and
 * per machine (no lock across NFS).
 */
import * as Context from "effect/Context"
import * as Data from "effect/Data"
import * as Effect from "effect/Effect"
import * as Layer from "effect/Layer"
import * as Option from "effect/Option"
import type * as Scope from "effect/Scope"
import { createHash } from "node:crypto"
import * as FileIo from "./internal/fileIo.js"
import * as net from "node:net"
import * as path from "node:path"

/** Who holds a state dir, as it answers on its lock. */
export interface Holder {
  readonly pid: number
  readonly socketPath: string
  readonly stateDir: string
}

/** Another process holds the state dir: `pid` and `socketPath` are absent if it did not say. */
export class StateDirLocked extends Data.TaggedError("StateDirLocked")<{
  readonly stateDir: string
  readonly pid: number | undefined
  readonly socketPath: string | undefined
}> {
  override get message(): string {
    return this.pid === undefined
      ? `another daemon (pid unknown, socket unknown: it did not answer on its lock) holds ${this.stateDir}`
      : `another daemon (pid ${this.pid}, socket ${this.socketPath}) holds ${this.stateDir}`
  }
}

/** The lock could not be taken for another reason than another holder (no access to the dir, ...). */
export class StateDirLockError extends Data.TaggedError("StateDirLockError")<{
  readonly stateDir: string
  readonly cause: unknown
}> {
  override get message(): string {
    const detail = this.cause instanceof Error ? this.cause.message : String(this.cause)
    return `cannot lock ${this.stateDir}: ${detail}`
  }
}

/** The lock this process holds. */
export class StateDirLock extends Context.Tag("agentd/StateDirLock")<StateDirLock, {
  /** The state dir as it was named. */
  readonly stateDir: string
  /** Its real path, which the lock's name is made from. */
  readonly realPath: string
}>() {}

/** How long a refused daemon waits for the holder to say who it is. */
const ANSWER_TIMEOUT_MS = 5000

/**
 * The abstract socket name of a state dir's lock (leading NUL: not a file). The uid keeps users
 * apart; the hash keeps it within the 107 bytes of a socket name whatever the path.
 */
export const lockName = (realPath: string): string =>
  `\0agentd-state-lock-${process.getuid?.() ?? 0}-${createHash("sha256").update(realPath).digest("hex")}`

/** The real path of a state dir, which must exist. */
const realPathOf = (stateDir: string) =>
  FileIo.realpath(path.resolve(stateDir)).pipe(Effect.mapError((e) => new StateDirLockError({ stateDir, cause: e.cause })))

/**
 * Asks the holder of `name` who it is (one JSON line). `held`: something is bound to the name
 * (the connection was accepted); `holder`: its answer, none if it gave none in time (a stopped
 * or wedged process still holds the name: the kernel accepts the connection for it).
 */
const ask = (name: string): Effect.Effect<{ readonly held: boolean; readonly holder: Option.Option<Holder> }> =>
  Effect.async((resume) => {
    const socket = net.connect(name)
    let connected = false
    let text = ""
    let done = false
    const finish = (holder: Option.Option<Holder>) => {
      if (done) return
      done = true
      clearTimeout(timer)
      socket.destroy()
      resume(Effect.succeed({ held: connected, holder }))
    }
    const timer = setTimeout(() => finish(Option.none()), ANSWER_TIMEOUT_MS)
    socket.setEncoding("utf8")
    socket.on("connect", () => (connected = true))
    socket.on("data", (chunk: string) => {
      text += chunk
      const end = text.indexOf("\n")
      if (end < 0) return
      try {
        const value = JSON.parse(text.slice(0, end)) as Partial<Holder>
        if (typeof value.pid === "number" && typeof value.socketPath === "string" && typeof value.stateDir === "string") {
          return finish(Option.some({ pid: value.pid, socketPath: value.socketPath, stateDir: value.stateDir }))
        }
      } catch {
        // not an agentd lock's answer
      }
      finish(Option.none())
    })
    socket.on("error", () => finish(Option.none()))
    socket.on("close", () => finish(Option.none()))
    return Effect.sync(() => finish(Option.none()))
  })

const locked = (stateDir: string, holder: Option.Option<Holder>) =>
  new StateDirLocked({
    stateDir,
    pid: Option.getOrUndefined(Option.map(holder, (h) => h.pid)),
    socketPath: Option.getOrUndefined(Option.map(holder, (h) => h.socketPath))
  })

/** Binds `name`: the server on success, `undefined` when it is taken. */
const bind = (name: string, answer: string, stateDir: string) =>
  Effect.async<net.Server | undefined, StateDirLockError>((resume) => {
    const server = net.createServer((connection) => {
      connection.on("error", () => undefined)
      connection.end(answer)
    })
    const onError = (err: NodeJS.ErrnoException) => {
      server.close()
      resume(err.code === "EADDRINUSE" ? Effect.succeed(undefined) : Effect.fail(new StateDirLockError({ stateDir, cause: err })))
    }
    server.once("error", onError)
    server.listen(name, () => {
      server.off("error", onError)
      server.on("error", () => undefined)
      // The lock must not keep the process alive by itself: it lives as long as the process.
      server.unref()
      resume(Effect.succeed(server))
    })
  })

/**
 * Takes the lock of `stateDir` (creating the dir, 0700, if it is missing: nothing else is
 * written before the lock is held) for the life of the scope; fails with {@link StateDirLocked}
 * naming the holder when another process has it. `socketPath` is what this process tells a
 * refused one. The kernel releases the lock if the process dies first.
 */
export const acquire = (options: { readonly stateDir: string; readonly socketPath: string }): Effect.Effect<
  StateDirLock["Type"],
  StateDirLocked | StateDirLockError,
  Scope.Scope
> =>
  Effect.gen(function*() {
    const stateDir = path.resolve(options.stateDir)
    yield* FileIo.ensureDir(stateDir).pipe(Effect.mapError((e) => new StateDirLockError({ stateDir, cause: e.cause })))
    const realPath = yield* realPathOf(stateDir)
    const name = lockName(realPath)
    const answer = `${JSON.stringify({ pid: process.pid, socketPath: options.socketPath, stateDir })}\n`
    // A holder that exits between our bind and our question leaves the name free: try again.
    for (let attempt = 0;; attempt++) {
      const server = yield* Effect.acquireRelease(
        bind(name, answer, stateDir),
        (server) =>
          server === undefined ? Effect.void : Effect.async<void>((resume) => {
            server.close(() => resume(Effect.void))
          })
      )
      if (server !== undefined) break
      const { held, holder } = yield* ask(name)
      if (held || attempt >= 5) return yield* locked(stateDir, holder)
    }
    return { stateDir, realPath }
  })

/**
 * Who holds `stateDir`, if anyone, without taking the lock and without writing anything (a state
 * dir that does not exist is held by no one). For `serve --detach`, which checks before it
 * starts a daemon (and before it opens the daemon's log in the state dir).
 */
export const holderOf = (stateDir: string): Effect.Effect<Option.Option<StateDirLocked>> =>
  Effect.gen(function*() {
    const resolved = path.resolve(stateDir)
    const real = yield* Effect.option(realPathOf(resolved))
    if (Option.isNone(real)) return Option.none()
    const { held, holder } = yield* ask(lockName(real.value))
    return held ? Option.some(locked(resolved, holder)) : Option.none()
  })

/** The lock as a layer: held from the layer's build to the end of its scope. */
export const layer = (
  options: { readonly stateDir: string; readonly socketPath: string }
): Layer.Layer<StateDirLock, StateDirLocked | StateDirLockError> => Layer.scoped(StateDirLock, acquire(options))

