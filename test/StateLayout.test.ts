/**
 * StateLayout: every path under a state dir, and the one sanitizer every store names ids with.
 */
import { assert, describe, it } from "@effect/vitest"
import * as path from "node:path"
import * as EventLog from "../src/EventLog.js"
import * as SnapshotCache from "../src/SnapshotCache.js"
import * as StateLayout from "../src/StateLayout.js"

const hostile = ["../../etc/x", ".", "..", "a/b", "a\\b", "\u0000", "snap.1", "日本", "%2F", "%", "~", "x".repeat(500)]

describe("StateLayout", () => {
  it("safeSegment never yields a path separator, a dot, an empty or an over-long name, and is injective", () => {
    for (const id of hostile) {
      const name = StateLayout.safeSegment(id)
      assert.match(name, /^[A-Za-z0-9_%~-]+$/)
      assert.isAtMost(name.length, 120)
      assert.strictEqual(path.basename(name), name)
    }
    assert.strictEqual(StateLayout.safeSegment(""), "%")
    assert.strictEqual(StateLayout.safeSegment("s-1234abcd-ef"), "s-1234abcd-ef")
    const ids = [...hostile, "", "a%2Fb", "a.b", "a%2Eb", "x".repeat(501), `${"x".repeat(500)}~`]
    assert.strictEqual(new Set(ids.map(StateLayout.safeSegment)).size, ids.length)
    // Read back, except the hashed ones.
    for (const id of ids.filter((i) => i.length < 100)) assert.strictEqual(StateLayout.segmentId(StateLayout.safeSegment(id)), id)
  })

  it("one sanitizer: the session store, the event log and the snapshot cache name an id alike", () => {
    const layout = StateLayout.make("/state")
    for (const id of hostile.filter((i) => i.length > 0)) {
      const name = StateLayout.safeSegment(id)
      assert.strictEqual(layout.store.sessionDir(id), path.join("/state", "sessions", name))
      assert.strictEqual(layout.events.sessionDir(id), path.join("/state", "events", name))
      assert.strictEqual(EventLog.sanitizeSessionId(id).pipe((e) => (e._tag === "Right" ? e.right : undefined)), name)
      assert.strictEqual(SnapshotCache.spillDirectoryName(id), name)
      assert.strictEqual(StateLayout.spillDir(layout.snapshotCacheDir(3), id), path.join("/state", "snapshot-cache", "3", name))
    }
  })

  it("names every path of a state dir", () => {
    const l = StateLayout.make("/state")
    assert.deepStrictEqual(
      [
        l.generationFile,
        l.journalFile,
        l.store.metaFile("s-1"),
        l.store.snapshotFile("s-1", 2),
        l.store.transcriptFile("s-1", 1),
        l.store.workDir("s-1"),
        l.store.archiveDir("s-1", "20261201T000000000Z"),
        l.events.eventsDir("s-1"),
        l.events.segmentFile(l.events.eventsDir("s-1"), 4),
        l.snapshotCacheDir(7)
      ],
      [
        "/state/supervisor-generation",
        "/state/recovery.jsonl",
        "/state/sessions/s-1/meta.json",
        "/state/sessions/s-1/snapshots/2.jsonl",
        "/state/sessions/s-1/transcripts/1.jsonl",
        "/state/sessions/s-1/work",
        "/state/archive/s-1-20261201T000000000Z",
        "/state/events/s-1/events",
        "/state/events/s-1/events/4.jsonl",
        "/state/snapshot-cache/7"
      ]
    )
  })
})
