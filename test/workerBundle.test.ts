/**
 * What an echo worker loads: the built worker bundle (dist/src/bin/worker.js) and the chunks it
 * imports statically, read as files. Loading `node:crypto` costs every worker ~2 MB of RSS
 * (OpenSSL); only a model engine's chunks (loaded by dynamic import) may need it.
 */
import { assert, describe, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import { fileURLToPath } from "node:url"

// The built entry (npm ci builds it through `prepare`).
const bin = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..", "dist", "src", "bin")

/** The files a module of the bundle imports statically (`import ... from "./x.js"`, `import "./x.js"`). */
const staticImports = (source: string): Array<string> =>
  [...source.matchAll(/(?:^|[;}\s])import(?:[^"'();]*?from)?\s*["']([^"']+)["']/g)].map((m) => m[1]!)

/** The worker entry and every bundle file it reaches by static imports; the node: modules they name. */
const reached = (): { files: Array<string>; builtins: Set<string> } => {
  const files: Array<string> = []
  const builtins = new Set<string>()
  const queue = [path.join(bin, "worker.js")]
  while (queue.length > 0) {
    const file = queue.pop()!
    if (files.includes(file)) continue
    files.push(file)
    for (const spec of staticImports(fs.readFileSync(file, "utf8"))) {
      if (spec.startsWith(".")) queue.push(path.resolve(path.dirname(file), spec))
      else builtins.add(spec)
    }
  }
  return { files, builtins }
}

describe("the worker bundle", () => {
  it("an echo worker's static imports reach no node:crypto (a model engine's chunks are dynamic imports)", () => {
    const { builtins, files } = reached()
    // The walk works: the entry imports its chunks, and node:net (its pipe).
    assert.isAbove(files.length, 1)
    assert.isTrue(builtins.has("node:net"), [...builtins].join(", "))
    assert.isFalse(builtins.has("node:crypto") || builtins.has("crypto"), `reached: ${files.map((f) => path.relative(bin, f)).join(", ")}`)
  })
})
