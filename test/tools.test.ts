/**
 * The model engines' built-in tools stay inside the session's working directory, symlinks
 * included.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import * as Tools from "../src/engines/tools.js"

const setup = () => {
  const root = fs.realpathSync(fs.mkdtempSync(path.join(os.tmpdir(), "agentd-tools-")))
  const cwd = path.join(root, "work")
  const outside = path.join(root, "outside")
  fs.mkdirSync(path.join(cwd, "sub"), { recursive: true })
  fs.mkdirSync(outside)
  fs.writeFileSync(path.join(cwd, "a.txt"), "inside")
  fs.writeFileSync(path.join(cwd, "sub", "b.txt"), "deeper")
  fs.writeFileSync(path.join(outside, "secret.txt"), "SECRET")
  fs.symlinkSync(path.join(outside, "secret.txt"), path.join(cwd, "link-out.txt"))
  fs.symlinkSync(outside, path.join(cwd, "dir-out"))
  fs.symlinkSync(path.join(cwd, "a.txt"), path.join(cwd, "link-in.txt"))
  return { root, cwd, outside }
}

describe("tools", () => {
  it.effect("read_file and list_dir work inside the working directory", () =>
    Effect.gen(function*() {
      const { cwd, root } = setup()
      assert.deepStrictEqual(yield* Tools.run(cwd, "read_file", { path: "a.txt" }), { result: "inside", isError: false })
      assert.deepStrictEqual(yield* Tools.run(cwd, "read_file", { path: "sub/../sub/b.txt" }), { result: "deeper", isError: false })
      assert.deepStrictEqual(yield* Tools.run(cwd, "read_file", { path: path.join(cwd, "a.txt") }), { result: "inside", isError: false })
      assert.deepStrictEqual(yield* Tools.run(cwd, "read_file", { path: "link-in.txt" }), { result: "inside", isError: false })
      const listing = yield* Tools.run(cwd, "list_dir", { path: "." })
      assert.deepStrictEqual(listing, { result: "a.txt\ndir-out@\nlink-in.txt@\nlink-out.txt@\nsub/", isError: false })
      fs.rmSync(root, { recursive: true, force: true })
    }))

  it.effect("anything outside is refused: .., absolute paths, symlinks to files and dirs outside", () =>
    Effect.gen(function*() {
      const { cwd, outside, root } = setup()
      for (const [name, p] of [
        ["read_file", "../outside/secret.txt"],
        ["read_file", path.join(outside, "secret.txt")],
        ["read_file", "link-out.txt"],
        ["read_file", "dir-out/secret.txt"],
        ["list_dir", ".."],
        ["list_dir", "dir-out"],
        ["list_dir", "/"]
      ] as const) {
        const out = yield* Tools.run(cwd, name, { path: p })
        assert.isTrue(out.isError, `${name} ${p}`)
        assert.include(out.result, "outside the working directory", `${name} ${p}`)
        assert.notInclude(out.result, "SECRET")
      }
      fs.rmSync(root, { recursive: true, force: true })
    }))

  it.effect("bad arguments and missing files are tool errors, not failures", () =>
    Effect.gen(function*() {
      const { cwd, root } = setup()
      assert.include((yield* Tools.run(cwd, "read_file", {})).result, "`path` must be a non-empty string")
      assert.include((yield* Tools.run(cwd, "read_file", { path: 3 })).result, "`path` must be a non-empty string")
      assert.include((yield* Tools.run(cwd, "read_file", { path: "nope.txt" })).result, "no such file")
      assert.include((yield* Tools.run(cwd, "read_file", { path: "sub" })).result, "is a directory")
      assert.include((yield* Tools.run(cwd, "list_dir", { path: "a.txt" })).result, "not a directory")
      assert.include((yield* Tools.run(cwd, "rm", { path: "a.txt" })).result, "unknown tool")
      fs.rmSync(root, { recursive: true, force: true })
    }))

  it.effect("a large file is cut at MAX_READ_BYTES, saying so", () =>
    Effect.gen(function*() {
      const { cwd, root } = setup()
      fs.writeFileSync(path.join(cwd, "big.txt"), "x".repeat(Tools.MAX_READ_BYTES + 10))
      const out = yield* Tools.run(cwd, "read_file", { path: "big.txt" })
      assert.isFalse(out.isError)
      assert.include(out.result, "[truncated")
      fs.rmSync(root, { recursive: true, force: true })
    }))
})
