/**
 * The runners' connections to one another (src/internal/cluster/transport.ts): an open to a
 * peer that never answers ends at the open's timeout, and its socket is destroyed. The peer is a
 * real listening socket whose accept queue is full (a helper process that never accepts): the
 * kernel drops the SYNs that come to it, as a partition does, so the client's connect stays in
 * SYN-SENT for as long as it is let. Issue #26: a connect started while a runner was cut off
 * waited about a minute after the link came back, every message to that runner behind it.
 */
import { assert, it } from "@effect/vitest"
import * as RunnerAddress from "@effect/cluster/RunnerAddress"
import * as Cause from "effect/Cause"
import * as Effect from "effect/Effect"
import * as Exit from "effect/Exit"
import * as Option from "effect/Option"
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as net from "node:net"
import * as Transport from "../src/internal/cluster/transport.js"

/** A listener on 127.0.0.1 that never accepts (backlog 0), killed at the scope's end; its port. */
const silentListener = Effect.acquireRelease(
  Effect.async<{ readonly port: number; readonly kill: () => void }, Error>((resume) => {
    const child = spawn("python3", [
      "-c",
      "import socket,sys,time\ns=socket.socket()\ns.bind(('127.0.0.1',0))\ns.listen(0)\nprint(s.getsockname()[1],flush=True)\ntime.sleep(600)"
    ], { stdio: ["ignore", "pipe", "inherit"] })
    child.once("error", (e) => resume(Effect.fail(e)))
    child.stdout.once("data", (d) => resume(Effect.succeed({ port: Number(String(d).trim()), kill: () => child.kill("SIGKILL") })))
    return Effect.sync(() => child.kill("SIGKILL"))
  }),
  (listener) => Effect.sync(() => listener.kill())
)

/**
 * Connects to `port` until a connect is still unanswered after 300 ms (the kernel's state, not
 * this process's events, which a loaded machine delays): the accept queue is full. The queued
 * connections are kept open till the scope's end; the unanswered one is destroyed.
 */
const fillAcceptQueue = (port: number) =>
  Effect.acquireRelease(
    Effect.promise(async () => {
      const sockets: Array<net.Socket> = []
      for (let i = 0; i < 16; i++) {
        const s = net.connect({ host: "127.0.0.1", port })
        s.on("error", () => {})
        await new Promise((resolve) => setTimeout(resolve, 300))
        if (synSentTo(port) > 0) {
          s.destroy()
          return sockets
        }
        sockets.push(s)
      }
      throw new Error(`the accept queue of port ${port} did not fill`)
    }),
    (sockets) => Effect.sync(() => sockets.forEach((s) => s.destroy()))
  )

/** Sockets of this machine in SYN-SENT to 127.0.0.1:`port` (/proc/net/tcp: state 02). */
const synSentTo = (port: number): number => {
  const remote = `0100007F:${port.toString(16).toUpperCase().padStart(4, "0")}`
  return fs.readFileSync("/proc/net/tcp", "utf8").split("\n").filter((line) => {
    const fields = line.trim().split(/\s+/)
    return fields[2] === remote && fields[3] === "02"
  }).length
}

it.scopedLive("an open to a runner that does not answer ends at its timeout, with its socket destroyed", () =>
  Effect.gen(function*() {
    const { port } = yield* silentListener
    yield* fillAcceptQueue(port)
    // The queue is full: a connect gets no answer (the probe that found it is destroyed already).
    assert.strictEqual(synSentTo(port), 0)
    const socket = yield* Transport.openSocket(new Transport.Connections(), RunnerAddress.make("127.0.0.1", port))
    const started = Date.now()
    // Disconnected: were the open uninterruptible (as before), the bound still answers.
    const exit = yield* Effect.exit(Effect.timeout(Effect.disconnect(socket.runRaw(() => {})), "8 seconds"))
    const tookMs = Date.now() - started
    assert.isTrue(Exit.isFailure(exit))
    const error = Exit.isFailure(exit) ? Option.getOrUndefined(Cause.failureOption(exit.cause)) : undefined
    assert.strictEqual(error?._tag, "SocketError", `the open ended with ${String(error)} after ${tookMs} ms`)
    assert.strictEqual((error as { reason?: string }).reason, "Open")
    // Nothing left trying: the socket of the open was destroyed with it.
    assert.strictEqual(synSentTo(port), 0, "a connect to the silent peer is still in SYN-SENT")
  }), { timeout: 30_000 })
