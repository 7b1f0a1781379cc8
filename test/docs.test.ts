/**
 * The docs' TypeScript is the package's: every ```ts block of README.md and docs/*.md is
 * compiled (the project's compiler and tsconfig; `agentd`, `agentd/client` and `agentd/worker`
 * resolved through the package's exports to its built types) and must have no type error.
 * Needs `npm run build` first. A snippet may use,
 * without declaring them, the names of {@link GIVEN} (a client, a session id, Effect's modules,
 * ...): each is declared for it unless the snippet declares or imports it itself.
 */
import { assert, describe, it } from "@effect/vitest"
import * as fs from "node:fs"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import ts from "typescript"

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..")

/** What a snippet may take as given, by name. */
const GIVEN: Readonly<Record<string, string>> = {
  Effect: `import * as Effect from "effect/Effect"`,
  Stream: `import * as Stream from "effect/Stream"`,
  Console: `import * as Console from "effect/Console"`,
  Layer: `import * as Layer from "effect/Layer"`,
  DaemonLive: `import { DaemonLive } from "agentd"`,
  RecoveryJournal: `import { RecoveryJournal } from "agentd"`,
  DaemonClient: `import { DaemonClient } from "agentd/client"`,
  fileURLToPath: `import { fileURLToPath } from "node:url"`,
  client: `declare const client: import("agentd/client").Client`,
  stateDir: `declare const stateDir: string`,
  socketPath: `declare const socketPath: string`,
  activeSessionId: `declare const activeSessionId: string`,
  cursorFile: `declare const cursorFile: string`,
  Engines: `declare const Engines: import("effect/Layer").Layer<import("agentd").Engine.Engine>`,
  describe: `declare const describe: (event: import("agentd/client").FollowEvent) => string`,
  program: `declare const program: import("effect/Effect").Effect<void, unknown, import("agentd/client").DaemonClient>`
}

interface Block {
  readonly file: string
  readonly line: number
  readonly code: string
}

const blocks = (file: string): Array<Block> => {
  const lines = fs.readFileSync(path.join(ROOT, file), "utf8").split("\n")
  const found: Array<Block> = []
  for (let i = 0; i < lines.length; i++) {
    if (!/^```(ts|typescript)\s*$/.test(lines[i]!)) continue
    const start = i + 1
    let end = start
    while (end < lines.length && !/^```\s*$/.test(lines[end]!)) end++
    found.push({ file, line: start + 1, code: lines.slice(start, end).join("\n") })
    i = end
  }
  return found
}

/** The block as a module: the givens it uses and does not declare itself, then its code. */
const moduleOf = (block: Block): { readonly text: string; readonly preludeLines: number } => {
  const declared = new Set<string>()
  for (const m of block.code.matchAll(/^\s*import\s+(?:\*\s+as\s+(\w+)|\{([^}]*)\}|(\w+))/gm)) {
    for (const name of (m[1] ?? m[3] ?? m[2] ?? "").split(",")) {
      const local = name.trim().split(/\s+as\s+/).pop()?.replace(/^type\s+/, "")
      if (local) declared.add(local)
    }
  }
  for (const m of block.code.matchAll(/^\s*(?:export\s+)?(?:const|let|function|class)\s+(\w+)/gm)) declared.add(m[1]!)
  const prelude = Object.entries(GIVEN)
    .filter(([name]) => !declared.has(name) && new RegExp(`\\b${name}\\b`).test(block.code))
    .map(([, declaration]) => declaration)
  return { text: [...prelude, "export {}", block.code].join("\n") + "\n", preludeLines: prelude.length + 1 }
}

describe("the docs' TypeScript", () => {
  it("every ts block of README.md and docs/*.md typechecks against the package", () => {
    const files = ["README.md", ...fs.readdirSync(path.join(ROOT, "docs")).filter((f) => f.endsWith(".md")).map((f) => `docs/${f}`)]
    const all = files.flatMap(blocks)
    assert.isAbove(all.length, 0)
    const config = ts.getParsedCommandLineOfConfigFile(path.join(ROOT, "tsconfig.json"), {}, {
      ...ts.sys,
      onUnRecoverableConfigFileDiagnostic: (d) => assert.fail(ts.flattenDiagnosticMessageText(d.messageText, "\n"))
    })!
    const virtual = new Map<string, { readonly block: Block; readonly text: string; readonly preludeLines: number }>()
    all.forEach((block, i) => {
      const m = moduleOf(block)
      // Beside the examples, so that module resolution (and the `agentd` paths) is theirs.
      virtual.set(path.join(ROOT, "examples", `__doc_block_${i}.mts`), { block, ...m })
    })
    // The package's published types (its exports map, as a user's compiler sees them; built by
    // `npm run build`), not its sources: the docs are for the package.
    const types = path.join(ROOT, "dist", "src", "client.d.ts")
    if (!fs.existsSync(types)) assert.fail(`${types} missing: run \`npm run build\` first`)
    const { paths: _sources, ...options } = { ...config.options, noEmit: true }
    const host = ts.createCompilerHost(options)
    const getSourceFile = host.getSourceFile.bind(host)
    const fileExists = host.fileExists.bind(host)
    const readFile = host.readFile.bind(host)
    host.getSourceFile = (name, language, onError, fresh) => {
      const v = virtual.get(path.resolve(name))
      return v === undefined ? getSourceFile(name, language, onError, fresh) : ts.createSourceFile(name, v.text, language, true)
    }
    host.fileExists = (name) => virtual.has(path.resolve(name)) || fileExists(name)
    host.readFile = (name) => virtual.get(path.resolve(name))?.text ?? readFile(name)
    const program = ts.createProgram({ rootNames: [...virtual.keys()], options, host })
    // The blocks' own diagnostics only (the package's files are `npm run typecheck`'s business,
    // and checking them all here would take a minute).
    const diagnostics = [...virtual.keys()].flatMap((name) => {
      const file = program.getSourceFile(name)!
      return [...program.getSyntacticDiagnostics(file), ...program.getSemanticDiagnostics(file)]
    })
    const problems = diagnostics.flatMap((d) => {
      const v = d.file === undefined ? undefined : virtual.get(path.resolve(d.file.fileName))
      if (v === undefined) return []
      const { line } = d.file!.getLineAndCharacterOfPosition(d.start ?? 0)
      const at = `${v.block.file}:${v.block.line + line - v.preludeLines}`
      return [`${at}: ${ts.flattenDiagnosticMessageText(d.messageText, "\n")}`]
    })
    assert.deepStrictEqual(problems, [])
  }, 180_000)
})
