/**
 * The HTTP front's pure parts: offsets (sort as cursors do, round-trip, refuse what is not
 * ours), the gate's Host/Origin/token checks, the listen address, the line sorter of event
 * reads, and the token file.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as Fiber from "effect/Fiber"
import * as Option from "effect/Option"
import * as Stream from "effect/Stream"
import * as TestClock from "effect/TestClock"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as Cursor from "../src/Cursor.js"
import { statusOf } from "../src/internal/http/errors.js"
import { dataEventOf, type Reader, readPage, sseStream } from "../src/internal/http/events.js"
import { cursorOfLine, type Item, LineSorter } from "../src/internal/http/lines.js"
import * as Offset from "../src/internal/http/offset.js"
import { StreamPort } from "../src/internal/http/port.js"
import * as Security from "../src/internal/http/security.js"
import { readOrCreateToken, tokenMatches } from "../src/internal/http/token.js"

describe("HTTP offsets", () => {
  it("round-trip, and sort lexicographically as cursors sort", () => {
    const cursors: Array<Cursor.Cursor> = []
    for (const g of [1, 2, 9, 10, 11, 99, 100, 12345]) for (const s of [0, 1, 9, 10, 99, 100, 1001, 2 ** 40]) cursors.push(Cursor.make(g, s))
    const shuffled = [...cursors].sort(() => Math.random() - 0.5)
    const byOffset = [...shuffled].sort((a, b) => (Offset.encode(a) < Offset.encode(b) ? -1 : 1))
    const byCursor = [...shuffled].sort(Cursor.compare)
    assert.deepStrictEqual(byOffset, byCursor)
    for (const c of cursors) assert.deepStrictEqual(Offset.decode(Offset.encode(c)), { _tag: "After", cursor: c })
    assert.isTrue(Offset.START < Offset.encode(Cursor.initial))
    assert.notInclude(Offset.encode(Cursor.make(3, 4)), ",")
  })

  it("-1, the zero offset and now; anything else is refused", () => {
    assert.deepStrictEqual(Offset.decode("-1"), { _tag: "Start" })
    assert.deepStrictEqual(Offset.decode(Offset.START), { _tag: "Start" })
    assert.deepStrictEqual(Offset.decode("now"), { _tag: "Now" })
    for (const bad of ["", "0", "1:2", "abc", "0000000000000001_000000000000001", "0000000000000000_0000000000000001", " 0000000000000001_0000000000000001", "-2", "NOW"]) {
      assert.isUndefined(Offset.decode(bad), bad)
    }
  })
})

describe("HTTP gate", () => {
  const bound = { host: "127.0.0.1", port: 7433 }

  it("parses listen addresses", () => {
    assert.deepStrictEqual(Security.parseListen("127.0.0.1:7433"), { host: "127.0.0.1", port: 7433 })
    assert.deepStrictEqual(Security.parseListen("7433"), { host: "127.0.0.1", port: 7433 })
    assert.deepStrictEqual(Security.parseListen(":0"), { host: "127.0.0.1", port: 0 })
    assert.deepStrictEqual(Security.parseListen("[::1]:80"), { host: "::1", port: 80 })
    assert.deepStrictEqual(Security.parseListen("LocalHost:1"), { host: "localhost", port: 1 })
    for (const bad of ["", "host", "1.2.3.4:99999", "::1:80", "a:b"]) assert.isString(Security.parseListen(bad), bad)
  })

  it("loopback: 127/8, ::1, localhost; nothing else", () => {
    for (const h of ["127.0.0.1", "127.1.2.3", "::1", "localhost"]) assert.isTrue(Security.isLoopback(h), h)
    for (const h of ["0.0.0.0", "::", "10.0.0.1", "192.168.1.1", "example.com", "localhost.example.com", "128.0.0.1"]) {
      assert.isFalse(Security.isLoopback(h), h)
    }
  })

  it("Host: our address or a loopback name on our port; no rebinding names; IP literals only on a wildcard bind", () => {
    for (const h of ["127.0.0.1:7433", "localhost:7433", "LOCALHOST:7433", "[::1]:7433"]) assert.isTrue(Security.hostAllowed(h, bound, 7433), h)
    for (const h of [undefined, "", "evil.com:7433", "127.0.0.1:7434", "127.0.0.1", "localhost.evil.com:7433", "10.0.0.1:7433", "127.0.0.1:7433:1", "[::1]"]) {
      assert.isFalse(Security.hostAllowed(h, bound, 7433), String(h))
    }
    const wild = { host: "0.0.0.0", port: 7433 }
    assert.isTrue(Security.hostAllowed("10.0.0.1:7433", wild, 7433))
    assert.isFalse(Security.hostAllowed("evil.com:7433", wild, 7433))
  })

  it("Origin: absent or our own; null and foreign ones refused", () => {
    assert.isTrue(Security.originAllowed(undefined, bound, 7433))
    for (const o of ["http://127.0.0.1:7433", "http://localhost:7433", "https://localhost:7433"]) assert.isTrue(Security.originAllowed(o, bound, 7433), o)
    for (const o of ["null", "http://evil.com", "http://127.0.0.1:7434", "http://127.0.0.1", "file://", "chrome-extension://abc", "http://localhost.evil.com:7433", "garbage"]) {
      assert.isFalse(Security.originAllowed(o, bound, 7433), o)
    }
  })

  it("the token: bearer first, else our cookie; compared whole", () => {
    assert.strictEqual(Security.presentedToken("Bearer abc", undefined), "abc")
    assert.strictEqual(Security.presentedToken("bearer  abc ", undefined), "abc")
    assert.isUndefined(Security.presentedToken("Basic abc", "agentd_token=abc"))
    assert.strictEqual(Security.presentedToken(undefined, "a=1; agentd_token=abc; b=2"), "abc")
    assert.isUndefined(Security.presentedToken(undefined, "xagentd_token=abc"))
    assert.isTrue(tokenMatches("secret-token", "secret-token"))
    for (const t of [undefined, "", "secret-toke", "secret-tokenx", "Secret-token", "secret-tokem"]) assert.isFalse(tokenMatches(t, "secret-token"), String(t))
  })

  it("check: Host, then Origin, then the token", () => {
    const ok = { host: "127.0.0.1:7433", authorization: "Bearer t" }
    assert.strictEqual(Security.check(ok, bound, 7433, "t")._tag, "Pass")
    const status = (h: Record<string, string>) => {
      const v = Security.check(h, bound, 7433, "t")
      return v._tag === "Refuse" ? v.status : 200
    }
    assert.strictEqual(status({ host: "evil:7433", authorization: "Bearer t", origin: "http://evil" }), 421)
    assert.strictEqual(status({ ...ok, origin: "http://evil" }), 403)
    assert.strictEqual(status({ host: "127.0.0.1:7433" }), 401)
    assert.strictEqual(status({ host: "127.0.0.1:7433", authorization: "Bearer u" }), 401)
  })

  it("one table of codes to statuses", () => {
    const expected: Record<string, number> = {
      session_not_found: 404,
      session_busy: 409,
      name_taken: 409,
      invalid_command: 400,
      parse_error: 400,
      line_too_long: 413,
      shutting_down: 503,
      method_not_allowed: 405,
      unauthorized: 401,
      offset_gone: 410,
      internal: 500,
      something_new: 500
    }
    for (const [code, status] of Object.entries(expected)) assert.strictEqual(statusOf(code), status, code)
  })
})

describe("HTTP event lines", () => {
  const line = (type: string, g: number, s: number, extra = "") =>
    `{"type":"${type}"${extra},"activeSessionId":"s-1","meta":{"cursor":{"generation":${g},"sequence":${s}},"emittedAt":1}}`

  it("reads the cursor from the line's end, whatever the event holds", () => {
    const tricky = line("session_event", 2, 5, `,"event":{"type":"x","text":",\\"meta\\":{\\"cursor\\":{\\"generation\\":9,\\"sequence\\":9}"}`)
    assert.deepStrictEqual(cursorOfLine(tricky), Cursor.make(2, 5))
  })

  it("sorts events, passes over snapshot frames, reports rewrites and losses, across split offers", () => {
    const sorter = new LineSorter()
    const out: Array<Item> = []
    const attached = `{"type":"session_attached","activeSessionId":"s-1"}\n`
    const e1 = line("session_event", 1, 0) + "\n"
    const begin = `{"type":"session_snapshot_begin","activeSessionId":"s-1","snapshotId":"snap-2","purpose":"replacement","cursor":{"generation":1,"sequence":0}}\n`
    const chunk = `{"type":"session_snapshot_chunk","activeSessionId":"s-1","snapshotId":"snap-2","index":0,"messages":[]}\n`
    const end = `{"type":"session_snapshot_end","activeSessionId":"s-1","snapshotId":"snap-2","chunkCount":1}\n`
    const e2 = line("session_status", 2, 0) + "\n"
    const all = attached + e1 + begin + chunk + end + e2
    sorter.push(new TextEncoder().encode(all.slice(0, 70)), out)
    sorter.push(all.slice(70), out)
    assert.deepStrictEqual(out.map((i) => i._tag), ["Event", "Rewrite", "Event"])
    assert.deepStrictEqual(out[1], { _tag: "Rewrite", snapshotId: "snap-2", cursor: Cursor.make(1, 0) })
    const lost: Array<Item> = []
    sorter.push(`{"type":"session_snapshot_begin","activeSessionId":"s-1","snapshotId":"snap-3","purpose":"resync"}\n`, lost)
    assert.deepStrictEqual(lost, [{ _tag: "Lost", reason: "resync" }])
  })

  it("a batch's SSE data event is made from its bytes: the lines as they are, one `data:` line each, `id:` its last offset", () => {
    // Multi-byte text everywhere, a line's end cut inside a character by the window the cursor
    // is read from, and a line whose content looks like a meta.
    const long = "é".repeat(200) + "😀"
    const lines = [
      line("session_event", 3, 7, `,"event":{"type":"message_update","delta":"${long}"}`),
      line("session_event", 3, 8, `,"event":{"type":"x","text":",\\"meta\\":{\\"cursor\\":{\\"generation\\":9,\\"sequence\\":9}"}`),
      line("session_status", 3, 9, `,"state":{"name":"${"ü".repeat(120)}"}`)
    ]
    const piece = new TextEncoder().encode(lines.map((l) => `${l}\n`).join(""))
    const made = dataEventOf(piece)
    assert.isNotNull(made)
    const text = new TextDecoder().decode(made!.bytes)
    assert.strictEqual(text, `event: data\nid: ${Offset.encode(Cursor.make(3, 9))}\ndata: [\ndata: ${lines.join(",\ndata: ")}\ndata: ]\n\n`)
    // What an EventSource hands its listener: the data lines joined with LF, a JSON array.
    const data = text.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n")
    assert.deepStrictEqual(JSON.parse(data), lines.map((l) => JSON.parse(l)))
    assert.deepStrictEqual(made!.last, Cursor.make(3, 9))
    assert.strictEqual(made!.count, 3)
    assert.strictEqual(made!.lineBytes, piece.length - 3)
    assert.isFalse(made!.closes)
    // A Uint8Array over part of a larger buffer (an offset into it) reads the same.
    const within = new Uint8Array(piece.length + 10)
    within.set(piece, 5)
    assert.strictEqual(new TextDecoder().decode(dataEventOf(within.subarray(5, 5 + piece.length))!.bytes), text)
    const closing = dataEventOf(new TextEncoder().encode(`${line("session_event", 3, 10)}\n${line("session_closed", 3, 11)}\n`))
    assert.isTrue(closing!.closes)
    assert.deepStrictEqual(closing!.last, Cursor.make(3, 11))
    // Not only whole event lines: sorted line by line by the caller instead.
    const enc = (t: string) => new TextEncoder().encode(t)
    assert.isNull(dataEventOf(enc("")))
    assert.isNull(dataEventOf(enc(`${lines[0]}\n${lines[1]}`)))
    assert.isNull(dataEventOf(enc(`${lines[0]}\n{"type":"session_snapshot_begin","snapshotId":"x","purpose":"replacement"}\n`)))
    assert.isNull(dataEventOf(enc(`{"type":"session_attached","activeSessionId":"s-1"}\n${lines[0]}\n`)))
    assert.isNull(dataEventOf(enc(`${lines[0]}\n\n`)))
    assert.isNull(dataEventOf(enc(`{"type":"session_event","event":{}}\n`)))
  })
})

describe("HTTP SSE stream", () => {
  const line = (sequence: number) =>
    `{"type":"session_event","event":{"type":"message_update","delta":"x"},"activeSessionId":"s","meta":{"cursor":{"generation":1,"sequence":${sequence}},"emittedAt":0}}\n`

  it.scoped("a keep-alive after every keepAliveMs without a write, none while data flows; the stream ends when its port closes", () =>
    Effect.gen(function*() {
      const port = new StreamPort()
      const reader: Reader = { port, sorter: new LineSorter(), pending: [], from: undefined, target: undefined, rewritten: false }
      const written: Array<string> = []
      const fiber = yield* sseStream(reader, { keepAliveMs: 1000, cursor: () => "c", snapshotLink: (id) => id }).pipe(
        Stream.runForEach((bytes) => Effect.sync(() => written.push(new TextDecoder().decode(bytes)))),
        Effect.forkScoped
      )
      const settle = Effect.repeatN(Effect.yieldNow(), 20)
      const keepAlives = () => written.filter((w) => w === ": keep-alive\n\n").length
      yield* settle
      assert.match(written[0]!, /^retry: 1000\n\nevent: control\n/)
      yield* TestClock.adjust(999)
      yield* settle
      assert.strictEqual(keepAlives(), 0)
      yield* TestClock.adjust(1)
      yield* settle
      assert.strictEqual(keepAlives(), 1)
      // Data every 600 ms for 3 s: no keep-alive meanwhile.
      for (let i = 0; i < 5; i++) {
        yield* TestClock.adjust(600)
        port.offer(line(i))
        yield* settle
      }
      assert.strictEqual(keepAlives(), 1)
      assert.strictEqual(written.filter((w) => w.startsWith("event: data\n")).length, 5)
      // Silent again: the next keep-alive 1000 ms after the last write, then every 1000 ms.
      yield* TestClock.adjust(999)
      yield* settle
      assert.strictEqual(keepAlives(), 1)
      yield* TestClock.adjust(1)
      yield* settle
      assert.strictEqual(keepAlives(), 2)
      yield* TestClock.adjust(1000)
      yield* settle
      assert.strictEqual(keepAlives(), 3)
      port.close()
      yield* Fiber.join(fiber)
    }))
})

describe("HTTP token file", () => {
  it("made once (0600), then read back; two makers agree", () => {
    const dir = path.join(fs.mkdtempSync(path.join(os.tmpdir(), "agentd-token-")), "state")
    try {
      const a = readOrCreateToken(dir)
      const b = readOrCreateToken(dir)
      assert.strictEqual(a, b)
      assert.match(a, /^[A-Za-z0-9_-]{43}$/)
      assert.strictEqual(fs.statSync(path.join(dir, "http-token")).mode & 0o777, 0o600)
      assert.strictEqual(fs.statSync(dir).mode & 0o777, 0o700)
      assert.deepStrictEqual(fs.readdirSync(dir), ["http-token"])
    } finally {
      fs.rmSync(path.dirname(dir), { recursive: true, force: true })
    }
  })
})

describe("HTTP page budget", () => {
  const line = (sequence: number) =>
    `{"type":"session_event","event":{"type":"message_update","delta":"x"},"activeSessionId":"s","meta":{"cursor":{"generation":1,"sequence":${sequence}},"emittedAt":0}}\n`

  it.effect("a spent budget reads as full (the catch-up stops offering) and ends the page where it is, without waiting", () =>
    Effect.gen(function*() {
      const budget = line(0).length * 2
      const port = new StreamPort(budget)
      port.offer(line(0))
      assert.isFalse(port.exhausted)
      assert.isBelow(port.queuedBytes, budget)
      port.offer(line(1))
      assert.isTrue(port.exhausted)
      // What the session's catch-up checks before each offer: it waits, and is released only by a close.
      assert.strictEqual(port.queuedBytes, Number.MAX_SAFE_INTEGER)
      const waiter = yield* Effect.fork(port.awaitBelow(1024))
      // The page takes both lines and ends there, short of the target, instead of waiting for more.
      const reader: Reader = { port, sorter: new LineSorter(), pending: [], from: Cursor.make(1, 0), target: Cursor.make(1, 99), rewritten: false }
      const page = yield* readPage(reader, 1024 * 1024, undefined)
      assert.deepStrictEqual(page.lines, [line(0).slice(0, -1), line(1).slice(0, -1)])
      assert.deepStrictEqual(page.next, Cursor.make(1, 1))
      assert.isFalse(page.upToDate)
      assert.isUndefined(yield* Fiber.poll(waiter).pipe(Effect.map(Option.getOrUndefined)))
      port.close()
      yield* Fiber.join(waiter)
    }))

  it.effect("a read from before a rewrite starts with it: the replacement's frames spend no budget, the page goes on from its cursor", () =>
    Effect.gen(function*() {
      const budget = line(0).length * 2
      const port = new StreamPort(budget)
      // A replacement snapshot far over the page's budget, then events of the new generation.
      port.offer(`{"type":"session_snapshot_begin","activeSessionId":"s","snapshotId":"snap-2","purpose":"replacement","cursor":{"generation":1,"sequence":5}}\n`)
      for (let i = 0; i < 10; i++) port.offer(Buffer.from(`{"type":"session_snapshot_chunk","snapshotId":"snap-2","index":${i},"messages":["${"x".repeat(budget)}"]}\n`))
      port.offer(`{"type":"session_snapshot_end","snapshotId":"snap-2"}\n`)
      assert.isFalse(port.exhausted)
      const event = line(0).replace('"generation":1,"sequence":0', '"generation":2,"sequence":0')
      port.offer(event)
      const reader: Reader = { port, sorter: new LineSorter(), pending: [], from: Cursor.make(1, 2), target: Cursor.make(2, 0), rewritten: true }
      const page = yield* readPage(reader, 1024 * 1024, undefined)
      assert.deepStrictEqual(page.rewrite, { snapshotId: "snap-2", cursor: Cursor.make(1, 5) })
      assert.deepStrictEqual(page.lines, [event.slice(0, -1)])
      assert.deepStrictEqual(page.next, Cursor.make(2, 0))
      assert.isTrue(page.upToDate)
      port.close()
    }))

  it.effect("without a budget (SSE) the port is never full for good", () =>
    Effect.gen(function*() {
      const port = new StreamPort()
      for (let i = 0; i < 1000; i++) port.offer(line(i))
      assert.isFalse(port.exhausted)
      port.takeAll()
      assert.strictEqual(port.queuedBytes, 0)
      yield* port.awaitBelow(1)
    }))
})
