/**
 * The built-in tools a model engine offers: `read_file` and `list_dir`, run inside the worker
 * under the session's working directory and never outside it.
 *
 * Confinement is decided on real paths: the working directory and the requested path are both
 * resolved through every symlink before the one is checked to contain the other, so a symlink
 * inside the directory that points outside it is refused like `../`. A file is then opened and
 * checked again through the descriptor (`/proc/self/fd`), so a path swapped for a symlink
 * between the check and the open is refused too.
 *
 * The tools' parameters are declared to the model as JSON schema but decoded leniently: a
 * model that sends a bad argument gets a tool error it can correct, rather than failing the
 * whole turn on a schema error.
 */
import * as Tool from "@effect/ai/Tool"
import * as Toolkit from "@effect/ai/Toolkit"
import * as Effect from "effect/Effect"
import * as Schema from "effect/Schema"
import * as FileIo from "../internal/fileIo.js"
import { readlinkSync } from "../internal/fileIoSync.js"
import * as nodePath from "node:path"

/** The most bytes `read_file` returns; the rest is cut with a note saying so. */
export const MAX_READ_BYTES = 256 * 1024
/** The most entries `list_dir` returns. */
export const MAX_DIR_ENTRIES = 1000

const PathParam = Schema.Unknown.annotations({
  jsonSchema: { type: "string", description: "A path relative to the working directory (\".\" is the working directory)." }
})

/** Reads a text file of the working directory. */
export const ReadFile = Tool.make("read_file", {
  description: "Read a text file inside the working directory. Returns its content (at most 256 KiB).",
  parameters: { path: PathParam },
  success: Schema.String,
  failure: Schema.String,
  failureMode: "return"
})

/** Lists a directory of the working directory. */
export const ListDir = Tool.make("list_dir", {
  description:
    "List the entries of a directory inside the working directory, one per line; directories end with '/', symlinks with '@'.",
  parameters: { path: PathParam },
  success: Schema.String,
  failure: Schema.String,
  failureMode: "return"
})

/** The toolkit the model engines declare to the model. */
export const toolkit = Toolkit.make(ReadFile, ListDir)

/** The names of the built-in tools. */
export type ToolName = keyof typeof toolkit.tools

/** What a tool call gave: a text for the model, and whether it is an error. */
export interface ToolOutcome {
  readonly result: string
  readonly isError: boolean
}

const within = (root: string, real: string): boolean => real === root || real.startsWith(root.endsWith(nodePath.sep) ? root : root + nodePath.sep)

const describeFsError = (e: unknown, shown: string): string => {
  const code = (e as NodeJS.ErrnoException | undefined)?.code
  switch (code) {
    case "ENOENT":
      return `${shown}: no such file or directory`
    case "ENOTDIR":
      return `${shown}: not a directory`
    case "EISDIR":
      return `${shown}: is a directory`
    case "EACCES":
    case "EPERM":
      return `${shown}: permission denied`
    case "ELOOP":
      return `${shown}: too many levels of symbolic links`
    default:
      return `${shown}: ${code ?? "cannot be read"}`
  }
}

class Refused extends Error {}

/**
 * The real path of `requested` inside `root` (itself a real path), or a refusal. Relative paths
 * are taken from the working directory; absolute ones must already lie inside it.
 */
const resolveInside = async (root: string, requested: unknown): Promise<string> => {
  if (typeof requested !== "string" || requested.length === 0) throw new Refused("`path` must be a non-empty string")
  if (requested.includes("\0")) throw new Refused("`path` must not contain NUL")
  const target = nodePath.resolve(root, requested)
  if (!within(root, target)) throw new Refused(`${requested}: outside the working directory`)
  let real: string
  try {
    real = await FileIo.realpathAsync(target)
  } catch (e) {
    throw new Refused(describeFsError(e, requested))
  }
  if (!within(root, real)) throw new Refused(`${requested}: outside the working directory (through a symlink)`)
  return real
}

/** Where a descriptor really points (Linux); undefined where that cannot be known. */
const fdPath = (fd: number): string | undefined => {
  try {
    return readlinkSync(`/proc/self/fd/${fd}`)
  } catch {
    return undefined
  }
}

const readFile = async (root: string, requested: unknown): Promise<string> => {
  const real = await resolveInside(root, requested)
  const shown = String(requested)
  let handle: FileIo.FileHandle
  try {
    handle = await FileIo.openAsync(real, FileIo.READ_NO_FOLLOW)
  } catch (e) {
    throw new Refused(describeFsError(e, shown))
  }
  try {
    const opened = fdPath(handle.fd)
    if (opened !== undefined && !within(root, opened)) throw new Refused(`${shown}: outside the working directory`)
    const stat = await handle.stat()
    if (stat.isDirectory()) throw new Refused(`${shown}: is a directory (use list_dir)`)
    if (!stat.isFile()) throw new Refused(`${shown}: not a regular file`)
    const buffer = Buffer.alloc(Math.min(stat.size, MAX_READ_BYTES))
    const { bytesRead } = await handle.read(buffer, 0, buffer.length, 0)
    const text = buffer.subarray(0, bytesRead).toString("utf8")
    return stat.size > MAX_READ_BYTES ? `${text}\n[truncated: the file has ${stat.size} bytes, shown ${MAX_READ_BYTES}]` : text
  } catch (e) {
    throw e instanceof Refused ? e : new Refused(describeFsError(e, shown))
  } finally {
    await handle.close()
  }
}

const listDir = async (root: string, requested: unknown): Promise<string> => {
  const real = await resolveInside(root, requested)
  const shown = String(requested)
  let entries: Array<{ readonly name: string; isDirectory(): boolean; isSymbolicLink(): boolean }>
  try {
    entries = await FileIo.readdirEntriesAsync(real)
  } catch (e) {
    throw new Refused(describeFsError(e, shown))
  }
  const names = entries
    .map((e) => e.name + (e.isDirectory() ? "/" : e.isSymbolicLink() ? "@" : ""))
    .sort()
  const shownNames = names.slice(0, MAX_DIR_ENTRIES)
  if (names.length > MAX_DIR_ENTRIES) shownNames.push(`[${names.length - MAX_DIR_ENTRIES} more entries not shown]`)
  return shownNames.length === 0 ? "(empty directory)" : shownNames.join("\n")
}

/**
 * Runs a tool call under `cwd`. Never fails: a refusal, a bad argument or an unknown tool is an
 * error result the model sees (and may correct).
 */
export const run = (cwd: string, name: string, params: unknown): Effect.Effect<ToolOutcome> =>
  Effect.promise(async (): Promise<ToolOutcome> => {
    const args = (typeof params === "object" && params !== null ? params : {}) as Record<string, unknown>
    try {
      const root = await FileIo.realpathAsync(cwd)
      switch (name) {
        case "read_file":
          return { result: await readFile(root, args["path"]), isError: false }
        case "list_dir":
          return { result: await listDir(root, args["path"]), isError: false }
        default:
          return { result: `unknown tool \`${name}\` (known: read_file, list_dir)`, isError: true }
      }
    } catch (e) {
      return { result: e instanceof Refused ? e.message : `${name} failed: ${describeFsError(e, "the working directory")}`, isError: true }
    }
  })
