/**
 * The daemon's program as `agentd serve` loads it: bundled on its own (dist/src/bin/agentd-serve.cjs),
 * so that the other commands never load the daemon's modules.
 */
import { fileURLToPath } from "node:url"
import type { ServeOptions } from "../cli/main.js"
import * as Serve from "../cli/serve.js"

/** Runs the daemon with the worker program next to this file (compiled module or bundle alike). */
export const serve = (options: ServeOptions): void =>
  Serve.serve({ ...options, workerEntry: fileURLToPath(new URL("./worker.js", import.meta.url)) })
