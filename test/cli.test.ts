/**
 * The command line's pure parts: the grammar (options in any order, `--x=v`, `--`, usage
 * errors, help), targets (id, name, prefix, ambiguity), the event renderer, and the list of
 * built-in engines against the daemon's registry.
 */
import { assert, describe, it } from "@effect/vitest"
import { commandHelp, mainHelp, parse, useColor } from "../src/cli/args.js"
import { builtinEngines } from "../src/cli/engines.js"
import { commands } from "../src/cli/main.js"
import { EventRenderer } from "../src/cli/render.js"
import { matches } from "../src/cli/target.js"
import * as BuiltinEngines from "../src/engines/builtin.js"
import type * as Protocol from "../src/Protocol.js"

const run = (argv: ReadonlyArray<string>) => {
  const r = parse(commands, argv)
  if (r._tag !== "Run") assert.fail(`expected a command, got ${JSON.stringify(r)}`)
  return { name: r.parsed.command.name, args: r.parsed.args, options: Object.fromEntries(r.parsed.options) }
}

describe("the grammar", () => {
  it("takes options before, between and after the arguments, and before the command", () => {
    const expected = { name: "prompt", args: ["demo", "hi"], options: { socket: "/s", json: true } }
    assert.deepStrictEqual(run(["prompt", "demo", "hi", "--socket", "/s", "--json"]), expected)
    assert.deepStrictEqual(run(["prompt", "--json", "demo", "--socket=/s", "hi"]), expected)
    assert.deepStrictEqual(run(["--socket", "/s", "prompt", "demo", "--json", "hi"]), expected)
    assert.deepStrictEqual(run(["serve", "--state-dir", "X", "--log-level", "debug"]).options, { "state-dir": "X", "log-level": "debug" })
    assert.deepStrictEqual(run(["prompt", "demo", "--", "--not-an-option"]).args, ["demo", "--not-an-option"])
    assert.deepStrictEqual(run(["prompt", "demo", "-"]).args, ["demo", "-"])
    assert.deepStrictEqual(run(["logs", "-f", "-n", "5"]).options, { follow: true, lines: 5 })
  })

  it("refuses what it does not know, with a usage error", () => {
    const error = (argv: ReadonlyArray<string>) => {
      const r = parse(commands, argv)
      if (r._tag !== "UsageError") assert.fail(`expected a usage error, got ${r._tag}`)
      return r.message
    }
    assert.include(error(["sesions"]), "did you mean `agentd sessions`")
    assert.include(error(["status", "--jsno"]), "did you mean --json")
    assert.include(error(["serve", "--engine", "nope"]), "unknown engine `nope` (known: echo, openai, openai-compat, anthropic)")
    assert.include(error(["serve", "--max-workers", "x"]), "whole number")
    assert.include(error(["state"]), "missing TARGET")
    assert.include(error(["state", "a", "b"]), `unexpected argument "b"`)
    assert.include(error(["create", "--name"]), "needs a value")
    assert.include(error(["status", "--json=yes"]), "takes no value")
  })

  it("help: `agentd help [command]`, --help anywhere, usage lines with agentd, colour only on a terminal without NO_COLOR", () => {
    assert.deepStrictEqual(parse(commands, []), { _tag: "Help", command: undefined })
    assert.deepStrictEqual(parse(commands, ["help"]), { _tag: "Help", command: undefined })
    const prompt = commands.find((c) => c.name === "prompt")
    assert.deepStrictEqual(parse(commands, ["help", "prompt"]), { _tag: "Help", command: prompt })
    assert.deepStrictEqual(parse(commands, ["prompt", "x", "--help"]), { _tag: "Help", command: prompt })
    assert.deepStrictEqual(parse(commands, ["--version"]), { _tag: "Version" })
    for (const c of commands) {
      const text = commandHelp(c, false)
      assert.include(text, `Usage: agentd ${c.name}`)
      assert.notInclude(text, "\x1b[")
      for (const o of c.options) assert.isAbove(o.description.length, 10, `${c.name} --${o.name} is described`)
      for (const a of c.args) assert.isAbove(a.description.length, 10, `${c.name} ${a.name} is described`)
    }
    assert.include(commandHelp(prompt!, true), "\x1b[1m")
    assert.notInclude(mainHelp(commands, false, ""), "\x1b[")
    assert.isFalse(useColor({ isTTY: false }, {}))
    assert.isTrue(useColor({ isTTY: true }, {}))
    assert.isFalse(useColor({ isTTY: true }, { NO_COLOR: "1" }))
  })

  it("--engine's choices are the daemon's built-in engines", () => {
    assert.deepStrictEqual(builtinEngines, Object.keys(BuiltinEngines.engines))
  })
})

const summary = (activeSessionId: string, name?: string): Protocol.SessionSummary => ({
  activeSessionId,
  ...(name === undefined ? {} : { name }),
  engine: "echo",
  createdAt: "2026-12-01T00:00:00.000Z",
  messageCount: 0,
  busy: false,
  worker: "ready",
  restarts: 0,
  telemetry: false
})

describe("targets", () => {
  const a = summary("s-aaaa1111-0000-0000-0000-000000000000", "alpha")
  const b = summary("s-aaaa2222-0000-0000-0000-000000000000", "beta")
  const c = summary("s-bbbb0000-0000-0000-0000-000000000000", "aaaa")
  const all = [a, b, c]
  const ids = (target: string) => matches(all, target).map((s) => s.activeSessionId)

  it("an id, then a name, then a unique prefix with or without s-", () => {
    assert.deepStrictEqual(ids(a.activeSessionId), [a.activeSessionId])
    assert.deepStrictEqual(ids("beta"), [b.activeSessionId])
    assert.deepStrictEqual(ids("aaaa1"), [a.activeSessionId])
    assert.deepStrictEqual(ids("s-aaaa2"), [b.activeSessionId])
    // A name wins over a prefix.
    assert.deepStrictEqual(ids("aaaa"), [c.activeSessionId])
  })

  it("several or none", () => {
    assert.deepStrictEqual(ids("s-aaaa"), [a.activeSessionId, b.activeSessionId])
    assert.deepStrictEqual(ids("zzz"), [])
    assert.deepStrictEqual(ids(""), [])
  })
})

describe("the event renderer", () => {
  const message = (id: string, role: Protocol.AgentMessage["role"], content: string, extra: Partial<Protocol.AgentMessage> = {}) => ({
    id,
    role,
    content,
    timestamp: 0,
    ...extra
  })

  it("user messages, streamed assistant text, tool calls and results on one line, turn ends", () => {
    let out = ""
    const r = new EventRenderer((s) => (out += s))
    const events: Array<Protocol.AgentEvent> = [
      { type: "agent_start" },
      { type: "message_start", message: message("u", "user", "hi\nthere") },
      { type: "message_end", message: message("u", "user", "hi\nthere") },
      { type: "tool_execution_start", toolCallId: "t", name: "sleep", args: { ms: 5 } },
      { type: "tool_execution_end", toolCallId: "t", result: "slept 5 ms", isError: false },
      { type: "message_start", message: message("t1", "tool", "", { toolCallId: "t", toolName: "sleep" }) },
      { type: "message_end", message: message("t1", "tool", "slept 5 ms", { toolCallId: "t", toolName: "sleep" }) },
      { type: "message_start", message: message("a", "assistant", "") },
      { type: "message_update", messageId: "a", delta: "echo:" },
      { type: "message_update", messageId: "a", delta: " hi" },
      { type: "message_end", message: message("a", "assistant", "echo: hi") },
      { type: "turn_end" },
      { type: "agent_end" },
      { type: "message_update", messageId: "late", delta: "partial" },
      { type: "turn_interrupted", reason: "worker_crashed" }
    ]
    for (const e of events) r.event(e)
    assert.strictEqual(
      out,
      [
        "> hi",
        "> there",
        `[tool sleep {"ms":5}]`,
        "[tool sleep -> slept 5 ms]",
        "echo: hi",
        "-- turn ended --",
        "partial",
        "-- turn interrupted (worker_crashed) --",
        ""
      ].join("\n")
    )
  })
})
