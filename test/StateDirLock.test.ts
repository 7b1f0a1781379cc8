/**
 * The state dir's lock with real processes: two racing for it, a holder killed with SIGKILL and
 * the lock taken again at once, the same dir named through a symlink, a relative path and a
 * trailing slash, a holder that cannot answer (stopped), and the refusal naming the holder.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import * as Scope from "effect/Scope"
import { type ChildProcessByStdio, spawn } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import type { Readable, Writable } from "node:stream"
import { afterEach } from "vitest"
import * as StateDirLock from "../src/StateDirLock.js"
import { childProgram } from "./support/fixtures.js"

// Bundled once for the run (test/support/fixturesGlobalSetup.ts): a start costs ~plain node's.
const childPath = childProgram("lockChild")

/** A lock child and the lines it printed. */
class Child {
  readonly lines: Array<string> = []
  exitCode: number | null | undefined = undefined
  readonly exited: Promise<void>
  private waiters: Array<() => void> = []

  constructor(readonly proc: ChildProcessByStdio<Writable, Readable, null>) {
    let buffer = ""
    proc.stdout.setEncoding("utf8")
    proc.stdout.on("data", (chunk: string) => {
      buffer += chunk
      for (let i = buffer.indexOf("\n"); i >= 0; i = buffer.indexOf("\n")) {
        this.lines.push(buffer.slice(0, i))
        buffer = buffer.slice(i + 1)
      }
      for (const w of this.waiters.splice(0)) w()
    })
    this.exited = new Promise((resolve) =>
      proc.once("exit", (code) => {
        this.exitCode = code
        for (const w of this.waiters.splice(0)) w()
        resolve()
      })
    )
  }

  get pid(): number {
    return this.proc.pid!
  }

  /** The first line starting with one of `prefixes`; fails after `timeoutMs`. */
  async line(prefixes: ReadonlyArray<string>, timeoutMs = 15_000): Promise<string> {
    const deadline = Date.now() + timeoutMs
    for (;;) {
      const found = this.lines.find((l) => prefixes.some((p) => l.startsWith(p)))
      if (found !== undefined) return found
      if (this.exitCode !== undefined && found === undefined) {
        throw new Error(`child ${this.pid} exited (${this.exitCode}) without ${prefixes.join("/")}: ${this.lines.join(" | ")}`)
      }
      const left = deadline - Date.now()
      if (left <= 0) throw new Error(`child ${this.pid}: no ${prefixes.join("/")} within ${timeoutMs} ms: ${this.lines.join(" | ")}`)
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, left)
        this.waiters.push(() => {
          clearTimeout(timer)
          resolve()
        })
      })
    }
  }
}

const children = new Set<Child>()
afterEach(() => {
  for (const c of children) {
    try {
      process.kill(c.pid, "SIGCONT")
      process.kill(c.pid, "SIGKILL")
    } catch {
      // gone
    }
  }
  children.clear()
})

/** Starts a child and waits until its modules are loaded (it takes the lock on `go`). */
const loadChild = (stateDir: string, socketPath: string) =>
  Effect.promise(async () => {
    const child = new Child(spawn(process.execPath, [childPath, stateDir, socketPath], { stdio: ["pipe", "pipe", "inherit"] }))
    children.add(child)
    await child.line(["loaded"])
    return child
  })

const go = (...cs: ReadonlyArray<Child>) => Effect.sync(() => cs.forEach((c) => c.proc.stdin.write("go\n")))

/** A child that holds the lock of `stateDir`. */
const holder = (stateDir: string, socketPath: string) =>
  Effect.gen(function*() {
    const child = yield* loadChild(stateDir, socketPath)
    yield* go(child)
    const line = yield* Effect.promise(() => child.line(["locked", "refused"]))
    assert.strictEqual(line, `locked ${child.pid}`)
    return child
  })

const tempRoot = () =>
  Effect.acquireRelease(
    Effect.sync(() => fs.realpathSync(fs.mkdtempSync(path.join(os.tmpdir(), "agentd-lock-")))),
    (root) => Effect.sync(() => fs.rmSync(root, { recursive: true, force: true }))
  )

const sigkill = (child: Child) =>
  Effect.promise(async () => {
    process.kill(child.pid, "SIGKILL")
    await child.exited
  })

const refusal = (stateDir: string, child: Child, socketPath: string) =>
  `another daemon (pid ${child.pid}, socket ${socketPath}) holds ${stateDir}`

/** Tries to take the lock in this process; the error if refused, none if taken (then released). */
const tryAcquire = (stateDir: string, socketPath = "/nowhere/test.sock") =>
  Effect.scoped(StateDirLock.acquire({ stateDir, socketPath })).pipe(
    Effect.map(() => Option.none<StateDirLock.StateDirLocked | StateDirLock.StateDirLockError>()),
    Effect.catchAll((e) => Effect.succeed(Option.some(e)))
  )

describe("StateDirLock", () => {
  it.scopedLive("two processes racing for one state dir: exactly one gets it, the other is told who did, every round", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot()
      const reused = path.join(root, "reused")
      for (let round = 0; round < 6; round++) {
        // Half the rounds on a state dir that does not exist yet (both create it), half on one
        // that the previous round's winner held.
        const stateDir = round % 2 === 0 ? path.join(root, `fresh-${round}`) : reused
        const [a, b] = yield* Effect.all([
          loadChild(stateDir, path.join(root, `a-${round}.sock`)),
          loadChild(stateDir, path.join(root, `b-${round}.sock`))
        ], { concurrency: 2 })
        yield* go(a, b)
        const [la, lb] = yield* Effect.promise(() => Promise.all([a.line(["locked", "refused"]), b.line(["locked", "refused"])]))
        const winners = [a, b].filter((c, i) => [la, lb][i]!.startsWith("locked"))
        assert.strictEqual(winners.length, 1, `round ${round}: ${la} / ${lb}`)
        const [winner, loser, lost] = la.startsWith("locked") ? [a, b, lb] : [b, a, la]
        assert.strictEqual(lost, `refused ${refusal(stateDir, winner, path.join(root, `${winner === a ? "a" : "b"}-${round}.sock`))}`)
        yield* Effect.promise(() => loser.exited)
        assert.strictEqual(loser.exitCode, 1)
        assert.isTrue(fs.existsSync(stateDir))
        // The winner still holds it.
        assert.isTrue(Option.isSome(yield* tryAcquire(stateDir)))
        yield* sigkill(winner)
      }
    }), 120_000)

  it.scopedLive("a holder killed with SIGKILL: the lock is free at once, first try, and answers for the new holder", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot()
      const stateDir = path.join(root, "state")
      for (let i = 0; i < 3; i++) {
        const child = yield* holder(stateDir, path.join(root, "agentd.sock"))
        const refused = yield* tryAcquire(stateDir)
        assert.strictEqual(Option.getOrThrow(refused).message, refusal(stateDir, child, path.join(root, "agentd.sock")))
        yield* sigkill(child)
        // No waiting, no stale-lock guess: the kernel freed the name with the process.
        const scope = yield* Scope.make()
        const lock = yield* Scope.extend(StateDirLock.acquire({ stateDir, socketPath: "/mine.sock" }), scope)
        assert.strictEqual(lock.realPath, stateDir)
        const held = yield* StateDirLock.holderOf(stateDir)
        assert.strictEqual(Option.getOrThrow(held).message, `another daemon (pid ${process.pid}, socket /mine.sock) holds ${stateDir}`)
        yield* Scope.close(scope, Exit.void)
        // Released with its scope.
        assert.isTrue(Option.isNone(yield* StateDirLock.holderOf(stateDir)))
      }
    }), 60_000)

  it.scopedLive("a symlink, a relative path and a trailing slash name the same lock", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot()
      const stateDir = path.join(root, "real", "state")
      const socketPath = path.join(root, "agentd.sock")
      const child = yield* holder(stateDir, socketPath)
      const link = path.join(root, "link")
      fs.symlinkSync(path.join(root, "real"), link)
      const viaLink = path.join(link, "state")
      const cwd = process.cwd()
      const relative = path.relative(cwd, stateDir)
      for (const [named, shown] of [[viaLink, viaLink], [`${stateDir}/`, stateDir], [relative, stateDir], [`${viaLink}/.`, viaLink]]) {
        const refused = yield* tryAcquire(named!)
        assert.isTrue(Option.isSome(refused), `${named} was not refused`)
        assert.strictEqual(Option.getOrThrow(refused).message, refusal(shown!, child, socketPath))
      }
      // The holder itself, asked through the link, is named the same way.
      assert.strictEqual(Option.getOrThrow(yield* StateDirLock.holderOf(viaLink)).message, refusal(viaLink, child, socketPath))
      // Another state dir is another lock.
      assert.isTrue(Option.isNone(yield* tryAcquire(path.join(root, "real", "other"))))
    }), 60_000)

  it.scopedLive("a holder that cannot answer (stopped) still holds the lock; the refusal says its pid is unknown", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot()
      const stateDir = path.join(root, "state")
      const child = yield* holder(stateDir, path.join(root, "agentd.sock"))
      process.kill(child.pid, "SIGSTOP")
      const refused = yield* tryAcquire(stateDir)
      process.kill(child.pid, "SIGCONT")
      assert.strictEqual(
        Option.getOrThrow(refused).message,
        `another daemon (pid unknown, socket unknown: it did not answer on its lock) holds ${stateDir}`
      )
      assert.strictEqual(Option.getOrThrow(refused)._tag, "StateDirLocked")
    }), 60_000)

  it.scopedLive("holderOf writes nothing: a state dir that does not exist stays absent", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot()
      const stateDir = path.join(root, "absent")
      assert.isTrue(Option.isNone(yield* StateDirLock.holderOf(stateDir)))
      assert.isFalse(fs.existsSync(stateDir))
    }))

  it.scopedLive("a state dir that cannot be made is a StateDirLockError, not a refusal", () =>
    Effect.gen(function*() {
      const root = yield* tempRoot()
      const file = path.join(root, "file")
      fs.writeFileSync(file, "")
      const error = Option.getOrThrow(yield* tryAcquire(path.join(file, "state")))
      assert.strictEqual(error._tag, "StateDirLockError")
      assert.include(error.message, `cannot lock ${path.join(file, "state")}`)
    }))
})
