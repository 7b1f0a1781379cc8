/**
 * A power-loss harness: what a file system would still hold after the power went out, for a
 * process that was SIGKILLed (after a SIGKILL the page cache survives, so a plain kill cannot
 * show that data acknowledged as durable would survive a power loss).
 *
 * Two halves:
 * - In the child, test/fixtures/powerLossPreload.ts (loaded with `node --import`, see
 *   {@link powerLossNodeArgs}) intercepts `node:fs` and keeps, per file under the state dir, its
 *   DURABLE IMAGE: the file's whole content as of its last fsync/fdatasync that completed, on
 *   any descriptor of it, in a side directory with a manifest ({@link Manifest}).
 * - In the parent, after the child was SIGKILLed, {@link simulatePowerLoss} rewrites every file
 *   under the state dir to what the power loss leaves of it (its image, then per variant some of
 *   the unsynced bytes or zeros), and {@link markAllDurable} starts a side dir from a state that
 *   is durable as a whole (before the next child runs on it).
 *
 * The model (what it does and does not cover) is written out in test/EventLogPowerLoss.test.ts's
 * header. In short: file CONTENTS are durable only up to a completed sync; directory entries
 * (create, rename, unlink, mkdir, rm) are durable at once (the code under test fsyncs the
 * directory after each anyway); a file without an image was never synced.
 *
 * This module holds no state and no side effect at load: the preload imports its pure parts
 * (the manifest's shape and updates), the tests its parent-side functions.
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { pathToFileURL } from "node:url"

/** Environment of a child under the harness: its side dir, its state dir, the syncs to skip. */
export const ENV_SIDE_DIR = "AGENTD_POWERLOSS_SIDE_DIR"
export const ENV_ROOT = "AGENTD_POWERLOSS_ROOT"
/**
 * A regular expression over a file's path relative to the state dir: fsync/fdatasync of matching
 * files report success WITHOUT syncing and without recording an image (the self-check's buggy
 * log: acknowledged, never durable).
 */
export const ENV_SKIP_SYNC = "AGENTD_POWERLOSS_SKIP_SYNC"

export const MANIFEST = "manifest.json"

/**
 * One file's durable image: the concatenation of these files of the side dir (a sync that only
 * appended to the file since its last image stores just the new bytes, as one more piece: the
 * write-ahead file grows to megabytes, and a copy of it per commit slowed the child 3-fold).
 */
export interface ImageEntry {
  readonly files: ReadonlyArray<string>
  readonly size: number
}

/**
 * The side dir's manifest, replaced whole (temp file, rename) after every change, so that a
 * SIGKILL leaves either the old or the new one; an image file is complete (temp, rename) before a
 * manifest names it. Keys are paths relative to the state dir, `/`-separated.
 */
export interface Manifest {
  version: 1
  images: Record<string, ImageEntry>
  /**
   * Renames under way (written before the real rename, removed after it): a kill between the
   * real rename and the manifest's update would otherwise leave the image under the old name.
   * {@link simulatePowerLoss} completes one whose source is gone and whose target exists.
   */
  pendingRenames: Array<{ readonly from: string | null; readonly to: string | null }>
  /** What the preload intercepted (for the tests' check that it sees the code under test). */
  stats: Record<string, number>
}

export const emptyManifest = (): Manifest => ({ version: 1, images: {}, pendingRenames: [], stats: {} })

const under = (key: string, prefix: string) => key === prefix || key.startsWith(prefix + "/")

/**
 * Applies a rename to the manifest (`null`: outside the state dir): the images at and under
 * `to` are dropped (a file renamed over another replaces it; a directory can only replace an
 * empty one), those at and under `from` move to `to`. Returns the image files no longer named.
 */
export const renameInManifest = (m: Manifest, from: string | null, to: string | null): Array<string> => {
  const dropped: Array<string> = []
  const moved: Array<[string, ImageEntry]> = []
  for (const [key, entry] of Object.entries(m.images)) {
    if (from !== null && under(key, from)) {
      delete m.images[key]
      if (to === null) dropped.push(...entry.files)
      else moved.push([to + key.slice(from.length), entry])
    } else if (to !== null && under(key, to)) {
      delete m.images[key]
      dropped.push(...entry.files)
    }
  }
  for (const [key, entry] of moved) m.images[key] = entry
  return dropped
}

/** Drops the images at and under `key` (unlink, rm); returns their image files. */
export const removeFromManifest = (m: Manifest, key: string): Array<string> => {
  const dropped: Array<string> = []
  for (const [k, entry] of Object.entries(m.images)) {
    if (under(k, key)) {
      delete m.images[k]
      dropped.push(...entry.files)
    }
  }
  return dropped
}

// ---------------------------------------------------------------------------------------------
// Parent side
// ---------------------------------------------------------------------------------------------

/** The node arguments (before the script) that load the preload built from test/fixtures/powerLossPreload.ts. */
export const powerLossNodeArgs = (bundledPreload: string): Array<string> => ["--import", pathToFileURL(bundledPreload).href]

/** The environment that points the preload at `stateDir` and `sideDir` (and the syncs to skip). */
export const powerLossEnv = (stateDir: string, sideDir: string, skipSync?: string): Record<string, string> => ({
  [ENV_ROOT]: stateDir,
  [ENV_SIDE_DIR]: sideDir,
  ...(skipSync === undefined ? {} : { [ENV_SKIP_SYNC]: skipSync })
})

export const readManifest = (sideDir: string): Manifest => {
  const file = path.join(sideDir, MANIFEST)
  if (!fs.existsSync(file)) return emptyManifest()
  return JSON.parse(fs.readFileSync(file, "utf8")) as Manifest
}

const writeManifest = (sideDir: string, m: Manifest) => {
  const file = path.join(sideDir, MANIFEST)
  fs.writeFileSync(`${file}.tmp`, JSON.stringify(m))
  fs.renameSync(`${file}.tmp`, file)
}

/** Regular files under `dir`, relative, `/`-separated, sorted (symbolic links are not followed). */
export const listFiles = (dir: string): Array<string> => {
  const out: Array<string> = []
  const walk = (rel: string) => {
    for (const entry of fs.readdirSync(path.join(dir, rel), { withFileTypes: true })) {
      const key = rel === "" ? entry.name : `${rel}/${entry.name}`
      if (entry.isDirectory()) walk(key)
      else if (entry.isFile()) out.push(key)
    }
  }
  if (fs.existsSync(dir)) walk("")
  return out.sort()
}

/**
 * Starts `sideDir` afresh with every file now under `stateDir` as durable (its current bytes as
 * its image): the state after a reboot, or after a clean close, which is where the next child
 * starts. Without it, a file the next child never syncs would read as never synced.
 */
export const markAllDurable = (stateDir: string, sideDir: string): void => {
  fs.rmSync(sideDir, { recursive: true, force: true })
  fs.mkdirSync(sideDir, { recursive: true })
  const m = emptyManifest()
  listFiles(stateDir).forEach((key, n) => {
    const file = `seed-${n}`
    const bytes = fs.readFileSync(path.join(stateDir, key))
    fs.writeFileSync(path.join(sideDir, file), bytes)
    m.images[key] = { files: [file], size: bytes.length }
  })
  writeManifest(sideDir, m)
}

/**
 * What the power loss leaves beyond a file's durable image:
 * - `drop`: nothing, exactly the image;
 * - `keep-prefix`: when the file as the process left it extends its image, the image and a random
 *   prefix (possibly empty, possibly all) of the bytes after it (written, some reached the disk);
 *   otherwise exactly the image;
 * - `zeros`: the image and a random-length run of zero bytes, at most as long as the file grew
 *   beyond its image (the size reached the disk, the data did not: what ext4/xfs can show).
 */
/** The bytes of an image. */
export const readImage = (sideDir: string, entry: ImageEntry): Buffer => {
  const bytes = Buffer.concat(entry.files.map((file) => fs.readFileSync(path.join(sideDir, file))))
  if (bytes.length !== entry.size) throw new Error(`power-loss image ${entry.files.join("+")}: ${bytes.length} bytes, the manifest says ${entry.size}`)
  return bytes
}

export type PowerLossVariant = "drop" | "keep-prefix" | "zeros"

export const VARIANTS: ReadonlyArray<PowerLossVariant> = ["drop", "keep-prefix", "zeros"]

export interface PowerLossOptions {
  /** A file never synced: emptied (`truncate`, the default: its entry was durable) or `remove`d. */
  readonly unsynced?: "truncate" | "remove"
  /** In [0, 1); Math.random by default (pass a seeded one to replay a failure). */
  readonly random?: () => number
}

export interface PowerLossReport {
  readonly files: number
  /** Files that had no image (emptied or removed). */
  readonly unsynced: ReadonlyArray<string>
  /** Bytes the power loss took (file length before minus after, where positive). */
  readonly bytesLost: number
  /** Unsynced bytes kept (`keep-prefix`) or zero bytes added (`zeros`). */
  readonly bytesKept: number
  readonly zeroBytes: number
  /** Renames the child had under way when it was killed, completed here. */
  readonly pendingRenamesCompleted: number
}

/**
 * Rewrites every regular file under `stateDir` (the child that wrote it must be dead: SIGKILL)
 * to what a power loss leaves of it, per `variant`, from the durable images `sideDir` holds.
 * `stateDir` may be a copy of the state dir the child ran on (the manifest's paths are relative).
 * Images of files no longer there are ignored: their unlink or rename was durable at once.
 */
export const simulatePowerLoss = (
  stateDir: string,
  sideDir: string,
  variant: PowerLossVariant,
  options: PowerLossOptions = {}
): PowerLossReport => {
  const random = options.random ?? Math.random
  const m = readManifest(sideDir)
  let pendingRenamesCompleted = 0
  for (const pending of m.pendingRenames) {
    const exists = (key: string | null) => key !== null && fs.existsSync(path.join(stateDir, key))
    // The real rename happened (its source is gone, its target is there): the entry is durable.
    if (pending.from !== null && !exists(pending.from) && (pending.to === null || exists(pending.to))) {
      renameInManifest(m, pending.from, pending.to)
      pendingRenamesCompleted++
    }
  }
  const unsynced: Array<string> = []
  let bytesLost = 0
  let bytesKept = 0
  let zeroBytes = 0
  const files = listFiles(stateDir)
  for (const key of files) {
    const file = path.join(stateDir, key)
    const real = fs.readFileSync(file)
    const entry = m.images[key]
    if (entry === undefined) {
      unsynced.push(key)
      if (options.unsynced === "remove") {
        fs.unlinkSync(file)
        bytesLost += real.length
        continue
      }
    }
    const image = entry === undefined ? Buffer.alloc(0) : readImage(sideDir, entry)
    const grew = real.length > image.length ? real.length - image.length : 0
    let tail: Buffer = Buffer.alloc(0)
    if (variant === "keep-prefix" && grew > 0 && real.subarray(0, image.length).equals(image)) {
      tail = real.subarray(image.length, image.length + Math.floor(random() * (grew + 1)))
      bytesKept += tail.length
    } else if (variant === "zeros" && grew > 0) {
      tail = Buffer.alloc(1 + Math.floor(random() * grew))
      zeroBytes += tail.length
    }
    const after = tail.length === 0 ? image : Buffer.concat([image, tail])
    if (real.length > after.length) bytesLost += real.length - after.length
    if (!after.equals(real)) fs.writeFileSync(file, after)
  }
  return { files: files.length, unsynced, bytesLost, bytesKept, zeroBytes, pendingRenamesCompleted }
}
