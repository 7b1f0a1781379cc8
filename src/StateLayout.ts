/**
 * Every path under a state dir, named in one place, with the one sanitizer that turns an id
 * from the wire into a path segment:
 *
 * ```
 * <stateDir>/agentd.sock                                  the default socket (see StatePaths)
 * <stateDir>/supervisor-generation                        +1 at every start
 * <stateDir>/recovery.jsonl                               the recovery journal
 * <stateDir>/events/<id>/events/<generation>.jsonl        event log segments, one per generation
 * <stateDir>/sessions/<id>/meta.json                      session metadata
 * <stateDir>/sessions/<id>/snapshots/<generation>.jsonl   a generation's transcript header (or whole)
 * <stateDir>/sessions/<id>/transcripts/<epoch>.jsonl      append-only messages shared by generations
 * <stateDir>/sessions/<id>/work/                          the session's work dir (its engine's tools)
 * <stateDir>/archive/<id>-<timestamp>/                    a killed session, moved there whole
 * <stateDir>/archive/<id>-<timestamp>/events/             its event log, moved beside it
 * <stateDir>/snapshot-cache/<supervisorGeneration>/<snapshotId>/<index>.jsonl   spilled snapshot chunks
 * ```
 * (`<id>` and `<snapshotId>` are {@link safeSegment}s.) The storage modules are rooted where an
 * embedder puts them (`SessionStore` at the state dir, `EventLog` at `events/`, `SnapshotCache`
 * at a generation's `snapshot-cache/` dir): each takes its paths from the functions here for its
 * root. Pure path logic (node:path and a hash), so that any module may load it.
 */
import * as path from "node:path"

export { defaultSocketPath, defaultStateDir, resolveSocketPath } from "./StatePaths.js"

/** Longest segment produced; file names are limited to 255 bytes. */
const MAX_SEGMENT = 120

/**
 * Turns an untrusted id (from the wire) into one path segment that cannot escape its parent:
 * letters, digits, `-` and `_` are kept, every other byte (including `.`, `/`, `%`) is written
 * `%XX`. The mapping is injective, so two ids never share a directory; `..`, `/` and NUL cannot
 * survive it. The empty id becomes `%` (which no encoding produces); a very long id is cut and
 * suffixed with `~` and a hash of the whole id (`~` is never produced by the encoding).
 */
export const safeSegment = (raw: string): string => {
  if (raw.length === 0) return "%"
  let out = ""
  for (const byte of Buffer.from(raw, "utf8")) {
    const isSafe = (byte >= 0x30 && byte <= 0x39) || (byte >= 0x41 && byte <= 0x5a) ||
      (byte >= 0x61 && byte <= 0x7a) || byte === 0x2d || byte === 0x5f
    out += isSafe ? String.fromCharCode(byte) : `%${byte.toString(16).toUpperCase().padStart(2, "0")}`
  }
  if (out.length <= MAX_SEGMENT) return out
  // node:crypto at its first use only (process.getBuiltinModule: Node 20.16, the engines floor):
  // loading it costs a process ~2 MB of RSS (OpenSSL), and a
  // worker, which loads this module, never needs it for the ids it is given.
  const digest = process.getBuiltinModule("node:crypto").createHash("sha256").update(raw, "utf8").digest("hex").slice(0, 32)
  return `${out.slice(0, MAX_SEGMENT - 33)}~${digest}`
}

/**
 * The id a {@link safeSegment} name stands for (`%XX` decoded); `undefined` for a name it cannot
 * have produced (or a hashed one, which does not say the whole id).
 */
export const segmentId = (name: string): string | undefined => {
  if (name === "%") return ""
  if (!/^(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+$/.test(name)) return undefined
  try {
    return decodeURIComponent(name)
  } catch {
    return undefined
  }
}

/** The session store's paths under `root` (the state dir). */
export const sessionStorePaths = (root: string) => {
  const sessions = path.join(root, "sessions")
  const archive = path.join(root, "archive")
  const sessionDir = (id: string) => path.join(sessions, safeSegment(id))
  const snapshotsDir = (id: string) => path.join(sessionDir(id), "snapshots")
  const transcriptsDir = (id: string) => path.join(sessionDir(id), "transcripts")
  return {
    sessions,
    archive,
    sessionDir,
    metaFile: (id: string) => path.join(sessionDir(id), "meta.json"),
    snapshotsDir,
    snapshotFile: (id: string, generation: number) => path.join(snapshotsDir(id), `${generation}.jsonl`),
    transcriptsDir,
    transcriptFile: (id: string, epoch: number) => path.join(transcriptsDir(id), `${epoch}.jsonl`),
    /** The session's work dir, for its engine's tools (not storage: the worker is given it). */
    workDir: (id: string) => path.join(sessionDir(id), "work"),
    /** Where a killed session's directory is moved (`stamp`: a sortable time without `:`). */
    archiveDir: (id: string, stamp: string) => path.join(archive, `${safeSegment(id)}-${stamp}`)
  }
}

/** Where a killed session's event log goes: inside its archived directory (`archiveDir`). */
export const archivedEventsDir = (archivedDir: string): string => path.join(archivedDir, "events")

/** An event log segment: one generation's events of one session. */
export const eventSegmentFile = (eventsDir: string, generation: number): string => path.join(eventsDir, `${generation}.jsonl`)

/** The event log's paths under `root` (`<stateDir>/events`). */
export const eventLogPaths = (root: string) => {
  const sessionDir = (id: string) => path.join(root, safeSegment(id))
  return {
    root,
    sessionDir,
    eventsDir: (id: string) => path.join(sessionDir(id), "events"),
    segmentFile: eventSegmentFile
  }
}

/** Where a snapshot's chunks spill under a cache root (`snapshot-cache/<supervisorGeneration>`). */
export const spillDir = (cacheRoot: string, snapshotId: string): string => path.join(cacheRoot, safeSegment(snapshotId))

/** Every path of one state dir. */
export const make = (stateDir: string) => ({
  stateDir,
  generationFile: path.join(stateDir, "supervisor-generation"),
  journalFile: path.join(stateDir, "recovery.jsonl"),
  /** The session store's root. */
  storeRoot: stateDir,
  store: sessionStorePaths(stateDir),
  /** The event log's root. */
  eventLogRoot: path.join(stateDir, "events"),
  events: eventLogPaths(path.join(stateDir, "events")),
  snapshotCacheRoot: path.join(stateDir, "snapshot-cache"),
  /** The snapshot cache's root for one supervisor generation (earlier ones are removed at start). */
  snapshotCacheDir: (supervisorGeneration: number) => path.join(stateDir, "snapshot-cache", String(supervisorGeneration))
})

/** Every path of one state dir (see {@link make}). */
export type StateLayout = ReturnType<typeof make>
