/**
 * An idle worker's collection (Worker.ts, idleGc) compacts an old space that plain full GCs
 * leave fragmented: they keep every page that holds a live object, and an idle echo worker kept
 * 2 MB of such pages resident (bench/workerMemory.ts). Run in a child with `gc` exposed.
 */
import { assert, describe, it } from "@effect/vitest"
import { execFile } from "node:child_process"
import { promisify } from "node:util"
import { COMPACT_FREE_BYTES } from "../src/Worker.js"
import { childProgram } from "./support/fixtures.js"

const mb = (bytes: number) => `${(bytes / (1024 * 1024)).toFixed(2)} MB`

describe("the idle worker's collection", () => {
  it("gives back the old space's free pages that plain full GCs keep, and leaves the later GCs plain", async () => {
    // A small new space, so that the child's objects are promoted as a worker's (which runs with one).
    const flags = ["--expose-gc", "--no-opt", "--no-sparkplug", "--max-semi-space-size=1"]
    const { stdout } = await promisify(execFile)(process.execPath, [...flags, childProgram("idleGcChild")], { timeout: 60_000 })
    const free = JSON.parse(stdout) as { afterPlainGc: number; afterIdleGc: number; afterPlainGcAgain: number }
    const seen = `free in the old space: ${mb(free.afterPlainGc)} after plain GCs, ${mb(free.afterIdleGc)} after idleGc, ` +
      `${mb(free.afterPlainGcAgain)} after plain GCs of a second fragmented heap`
    // The fragmentation is real, and above the threshold from which idleGc compacts.
    assert.isAbove(free.afterPlainGc, 1.5 * COMPACT_FREE_BYTES, seen)
    // The idle collection compacts it away (a few pages' worth stays: the one being filled).
    assert.isBelow(free.afterIdleGc, free.afterPlainGc / 2, seen)
    // The compaction's flag was set back: plain GCs leave the second heap fragmented.
    assert.isAbove(free.afterPlainGcAgain, 1.5 * COMPACT_FREE_BYTES, seen)
  })
})
