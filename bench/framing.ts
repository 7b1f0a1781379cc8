/**
 * Framing + decode of 1M small command lines, against `split("\n")` + `JSON.parse` on the same
 * bytes in the same run. The headline figure is the daemon's own read path (DaemonServer: a
 * `JsonLines.LineDecoder` fed each socket chunk, then `decodeCommandLine` per line); the same
 * work through `JsonLines.splitLines` as an Effect Stream is printed next to it.
 */
import * as Effect from "effect/Effect"
import * as Either from "effect/Either"
import * as Stream from "effect/Stream"
import * as JsonLines from "../src/JsonLines.js"
import * as Protocol from "../src/Protocol.js"
import { printRatio } from "./report.js"

const LINES = 1_000_000
const CHUNK = 64 * 1024

const makeInput = (): Array<Buffer> => {
  const kinds = [
    (i: number) => ({ type: "ping", id: `p${i}` }),
    (i: number) => ({ type: "prompt", id: `c${i}`, activeSessionId: "s-1", message: `hello ${i}` }),
    (i: number) => Protocol.encodeCommand(`e${i}`, { type: "get_state", activeSessionId: "s-2" }).trimEnd(),
    (i: number) => ({ type: "attach", id: `a${i}`, activeSessionId: "s-3", resumeCursor: { generation: 2, sequence: i } })
  ]
  let text = ""
  for (let i = 0; i < LINES; i++) {
    const v = kinds[i % kinds.length]!(i)
    text += (typeof v === "string" ? v : JSON.stringify(v)) + "\n"
  }
  const all = Buffer.from(text)
  const chunks: Array<Buffer> = []
  for (let i = 0; i < all.length; i += CHUNK) chunks.push(all.subarray(i, i + CHUNK))
  return chunks
}

/** As DaemonServer reads a socket: one LineDecoder, fed chunk by chunk. */
const server = (chunks: ReadonlyArray<Buffer>): number => {
  const decoder = new JsonLines.LineDecoder()
  let n = 0
  for (const chunk of chunks) {
    for (const item of decoder.push(chunk)) {
      if (typeof item === "string" && Either.isRight(Protocol.decodeCommandLine(item))) n++
    }
  }
  for (const item of decoder.end()) {
    if (typeof item === "string" && Either.isRight(Protocol.decodeCommandLine(item))) n++
  }
  return n
}

/** The same through `JsonLines.splitLines`, for code that consumes a Stream of bytes. */
const stream = (chunks: ReadonlyArray<Buffer>) => {
  let n = 0
  return Stream.fromIterable(chunks).pipe(
    JsonLines.splitLines(),
    // Per chunk, as the server consumes it (Stream.runFold recurses per element and overflows
    // the stack on chunks of thousands of lines).
    Stream.runForEachChunk((items) =>
      Effect.sync(() => {
        for (const item of items) {
          if (typeof item === "string" && Either.isRight(Protocol.decodeCommandLine(item))) n++
        }
      })
    ),
    Effect.map(() => n),
    Effect.runPromise
  )
}

const baseline = (chunks: ReadonlyArray<Buffer>): number => {
  // The naive way: concatenate everything, split, parse. No limits, no validation.
  let n = 0
  let rest = ""
  for (const chunk of chunks) {
    const parts = (rest + chunk.toString("utf8")).split("\n")
    rest = parts.pop() ?? ""
    for (const line of parts) if (line.length > 0 && JSON.parse(line) !== null) n++
  }
  return n
}

const time = async (f: () => number | Promise<number>): Promise<{ count: number; seconds: number }> => {
  const started = process.hrtime.bigint()
  const count = await f()
  return { count, seconds: Number(process.hrtime.bigint() - started) / 1e9 }
}

export default async function framing(): Promise<void> {
  const chunks = makeInput()
  // Warm up both paths so the JIT does not favour the second one measured.
  server(chunks.slice(0, 20))
  await stream(chunks.slice(0, 20))
  baseline(chunks.slice(0, 20))
  const base = await time(() => baseline(chunks))
  const ours = await time(() => server(chunks))
  const viaStream = await time(() => stream(chunks))
  if (ours.count !== LINES || base.count !== LINES || viaStream.count !== LINES) {
    throw new Error(`framing bench decoded ${ours.count} / ${viaStream.count} / ${base.count} of ${LINES} lines`)
  }
  printRatio({
    what: `framing + decode of ${LINES} command lines (the daemon's read path)`,
    unit: "lines/s",
    ours: ours.count / ours.seconds,
    baseline: base.count / base.seconds,
    baselineName: "split(\"\\n\") + JSON.parse",
    target: 0.5
  })
  const rate = viaStream.count / viaStream.seconds
  console.log(`  through JsonLines.splitLines as an Effect Stream: ${Math.round(rate).toLocaleString("en-US")} lines/s, ratio ${(rate / (base.count / base.seconds)).toFixed(2)}x`)
}
