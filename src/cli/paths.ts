/** Where a command line finds the daemon: its state dir and socket, from the options and the environment. */
import * as path from "node:path"
import { defaultStateDir, resolveSocketPath } from "../StatePaths.js"
import type { Parsed } from "./args.js"

export const stateDirOf = (p: Parsed) => path.resolve((p.options.get("state-dir") as string | undefined) ?? defaultStateDir())

export const socketOf = (p: Parsed) => resolveSocketPath(stateDirOf(p), p.options.get("socket") as string | undefined)
