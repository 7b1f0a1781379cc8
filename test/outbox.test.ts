/**
 * The connection outbox's end at a stop (`endWith`): the line given is the last one the peer
 * gets, whatever a delivery offers after it, and nobody waits for room any more, even when the
 * peer never reads.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { Outbox } from "../src/internal/outbox.js"

/** A connected pair of sockets over a Unix socket in a temp dir, closed after `f`. */
const withPair = <A>(f: (server: net.Socket, client: net.Socket) => Promise<A>): Promise<A> =>
  new Promise<A>((resolve, reject) => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "outbox-"))
    const socketPath = path.join(dir, "s.sock")
    const listener = net.createServer({ allowHalfOpen: true }, (server) => {
      f(server, client).then(resolve, reject).finally(() => {
        server.destroy()
        client.destroy()
        listener.close()
        fs.rmSync(dir, { recursive: true, force: true })
      })
    })
    let client: net.Socket
    listener.listen(socketPath, () => {
      client = net.createConnection({ path: socketPath })
      client.on("error", () => {})
    })
  })

/** Everything the peer reads until the daemon's side ends its write side. */
const readToEnd = (client: net.Socket): Promise<string> =>
  new Promise((resolve) => {
    let text = ""
    client.setEncoding("utf8")
    client.on("data", (d: string) => (text += d))
    client.on("end", () => resolve(text))
  })

describe("Outbox.endWith", () => {
  it("the given line is the last the peer reads, after what was queued; later offers are dropped; then end of stream", () =>
    withPair(async (server, client) => {
      const outbox = new Outbox(server)
      const read = readToEnd(client)
      outbox.offer("a\n")
      outbox.offer(Buffer.from("b\n"))
      outbox.endWith("closing\n")
      outbox.offer("after\n")
      assert.isTrue(outbox.isClosed)
      assert.strictEqual(await read, "a\nb\nclosing\n")
    }))

  it.live("a delivery waiting for room stops waiting at endWith, though the peer never reads", () =>
    Effect.promise(() =>
      withPair(async (server, client) => {
        client.pause()
        const outbox = new Outbox(server)
        // Far more than the socket buffers hold: most of it stays queued.
        const chunk = "x".repeat(64 * 1024) + "\n"
        for (let i = 0; i < 64; i++) outbox.offer(chunk)
        assert.isAbove(outbox.queuedBytes, 1024 * 1024)
        const waiting = Effect.runPromise(outbox.awaitBelow(1024))
        let released = false
        void waiting.then(() => (released = true))
        await new Promise((r) => setTimeout(r, 50))
        assert.isFalse(released, "the peer reads nothing: no room yet")
        outbox.endWith("closing\n")
        await waiting
        assert.isTrue(outbox.isClosed)
      })
    ))
})

describe("Outbox batches", () => {
  it("what is offered in one synchronous run goes out as one write; the next run's as another", () =>
    withPair(async (server, client) => {
      const writes: Array<number> = []
      const write = server.write.bind(server)
      server.write = ((chunk: Uint8Array, cb?: () => void) => {
        writes.push(chunk.byteLength)
        return write(chunk, cb)
      }) as typeof server.write
      const outbox = new Outbox(server)
      const read = readToEnd(client)
      for (let i = 0; i < 100; i++) outbox.offer(`line ${i}\n`)
      await new Promise((r) => setImmediate(r))
      outbox.offer("last\n")
      outbox.endWhenFlushed()
      const text = await read
      assert.strictEqual(text.split("\n").length - 1, 101)
      assert.deepStrictEqual(writes.length, 2, `one write per run: ${writes.join(", ")}`)
    }))

  it.live("the peer gone while lines are offered: the outbox closes at the failed write, waiters are released, later offers are dropped, the event loop turns on", () =>
    Effect.promise(() =>
      withPair(async (server, client) => {
        server.on("error", () => {})
        const outbox = new Outbox(server)
        const chunk = "x".repeat(64 * 1024) + "\n"
        client.destroy()
        // Deliveries go on, one run per turn of the event loop, until the outbox says it is closed.
        let runs = 0
        await new Promise<void>((resolve) => {
          const deliver = () => {
            if (outbox.isClosed || ++runs > 1000) return resolve()
            for (let i = 0; i < 4; i++) outbox.offer(chunk)
            setImmediate(deliver)
          }
          deliver()
        })
        assert.isTrue(outbox.isClosed, `closed after ${runs} runs`)
        await Effect.runPromise(outbox.awaitBelow(1))
        outbox.offer(chunk)
        assert.strictEqual(outbox.queuedBytes, 0)
        // A timer still fires: nothing spins on ticks.
        await new Promise((r) => setTimeout(r, 20))
      })
    ))
})

/** Waits (10 s at most) until `calls` holds `count` entries. */
const untilCalled = async (calls: ReadonlyArray<string>, count: number) => {
  const deadline = Date.now() + 10_000
  while (calls.length < count && Date.now() < deadline) await new Promise((r) => setTimeout(r, 5))
}

describe("Outbox done callbacks (a snapshot chunk's buffer is lent back to the cache by them)", () => {
  it.live("done runs only once the kernel took the bytes: not while the peer reads nothing, then once it read them", () =>
    Effect.promise(() =>
      withPair(async (server, client) => {
        client.pause()
        const outbox = new Outbox(server)
        // More than a Unix socket's buffers take: the write cannot finish until the peer reads.
        const big = Buffer.alloc(8 * 1024 * 1024, 0x61)
        big[big.length - 1] = 0x0a
        const calls: Array<string> = []
        outbox.offer("first\n", () => calls.push("first"))
        outbox.offer(big, () => calls.push("big"))
        // A second batch, queued behind the first while it is being written.
        await new Promise((r) => setImmediate(r))
        outbox.offer("after\n", () => calls.push("after"))
        await new Promise((r) => setTimeout(r, 200))
        assert.deepStrictEqual(calls, [])
        client.on("data", () => {})
        client.resume()
        await untilCalled(calls, 3)
        assert.deepStrictEqual(calls, ["first", "big", "after"])
        assert.strictEqual(outbox.queuedBytes, 0)
      })))

  it.live("what is dropped (queued at the close, or offered after it) gets its done at once; a batch being written gets its own when its write ends", () =>
    Effect.promise(() =>
      withPair(async (server, client) => {
        client.pause()
        const outbox = new Outbox(server)
        const big = Buffer.alloc(8 * 1024 * 1024, 0x62)
        const calls: Array<string> = []
        outbox.offer(big, () => calls.push("writing"))
        await new Promise((r) => setImmediate(r))
        outbox.offer("queued\n", () => calls.push("queued"))
        outbox.close()
        assert.deepStrictEqual(calls, ["queued"])
        outbox.offer("late\n", () => calls.push("late"))
        assert.deepStrictEqual(calls, ["queued", "late"])
        // The peer goes: the write being made ends (with an error), and only then its done runs.
        client.destroy()
        server.destroy()
        await untilCalled(calls, 3)
        assert.deepStrictEqual(calls, ["queued", "late", "writing"])
      })))
})
