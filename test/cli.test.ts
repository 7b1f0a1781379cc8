/**
 * The command line's parts: the grammar (options in any order, `--x=v`, `--`, usage errors,
 * help), targets (id, name, prefix, ambiguity), the event renderer, the list of built-in
 * engines against the daemon's registry, and the one-shot commands' connection against a
 * scripted peer on a real socket.
 */
import { assert, describe, it } from "@effect/vitest"
import * as Effect from "effect/Effect"
import * as fs from "node:fs"
import * as net from "node:net"
import * as os from "node:os"
import * as path from "node:path"
import { onTestFinished } from "vitest"
import { commandHelp, mainHelp, parse, useColor } from "../src/cli/args.js"
import { connect, withConnection } from "../src/cli/connection.js"
import { builtinEngines, engineOptions, optionValue } from "../src/cli/engines.js"
import { createConfig } from "../src/cli/commands.js"
import { type CliError, daemonErrorText, EXIT, isCliError, noDaemonText } from "../src/cli/errors.js"
import { commands } from "../src/cli/main.js"
import { count, EventRenderer, message } from "../src/cli/render.js"
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
    assert.include(error(["serve", "--shutdown-grace-ms", "-1"]), "whole number")
    assert.deepStrictEqual(run(["serve", "--shutdown-grace-ms", "0"]).options, { "shutdown-grace-ms": 0 })
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

  it.effect("--set's table of options and types is each built-in engine's own (known keys, and a value of the wrong type refused by name)", () =>
    Effect.gen(function*() {
      assert.deepStrictEqual(Object.keys(engineOptions), builtinEngines)
      for (const [engine, options] of Object.entries(engineOptions)) {
        const definition = BuiltinEngines.engines[engine]!
        const unknown = yield* Effect.flip(definition.validate({ "no-such-option": 1 }))
        const known = /\(known: ([^)]*)\)/.exec(unknown.message)?.[1]?.split(", ")
        assert.deepStrictEqual(known?.slice().sort(), Object.keys(options).sort(), `${engine}: ${unknown.message}`)
        for (const [key, type] of Object.entries(options)) {
          const wrong = type === "string" ? 5 : type === "number" ? "five" : "yes"
          const e = yield* Effect.flip(definition.validate({ [key]: wrong }))
          assert.include(e.message, `config.${key}`, `${engine}.${key}`)
          assert.notInclude(e.message, "unknown option", `${engine}.${key}`)
        }
      }
    }))

  it("--config and --set make create's config: values typed by the option, --set over --config, bad input a usage error", () => {
    assert.deepStrictEqual(createConfig({}), undefined)
    assert.deepStrictEqual(createConfig({ engine: "echo", set: ["tokenDelayMs=20"] }), { tokenDelayMs: 20 })
    assert.deepStrictEqual(
      createConfig({ engine: "openai", config: "{\"model\":\"a\",\"temperature\":1}", set: ["model=1234", "temperature=0.5", "maxTokens=1e3"] }),
      { model: "1234", temperature: 0.5, maxTokens: 1000 }
    )
    // Without --engine: the type any built-in engine gives the option; unknown options by their look.
    assert.deepStrictEqual(createConfig({ set: ["model=42", "tokenDelayMs=3", "flag=true", "other=x=y", "n=null"] }), {
      model: "42",
      tokenDelayMs: 3,
      flag: true,
      other: "x=y",
      n: null
    })
    // A number option given text stays text: the daemon refuses it, naming the option.
    assert.strictEqual(optionValue("echo", "tokenDelayMs", "fast"), "fast")
    const proto = createConfig({ set: ["__proto__=1"] })!
    assert.strictEqual(Object.getPrototypeOf(proto), Object.prototype)
    assert.deepStrictEqual(Object.keys(proto), ["__proto__"])
    for (const bad of [{ config: "{" }, { config: "[1]" }, { config: "null" }, { set: ["novalue"] }, { set: ["=1"] }]) {
      let thrown: unknown
      try {
        createConfig(bad)
      } catch (e) {
        thrown = e
      }
      assert.isTrue(isCliError(thrown) && thrown.exitCode === EXIT.usage, JSON.stringify(bad))
    }
  })

  it("--set is repeatable, in order", () => {
    assert.deepStrictEqual(run(["create", "--set", "a=1", "--set=b=2", "--engine", "echo"]).options, { set: ["a=1", "b=2"], engine: "echo" })
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

describe("the renderer: a failed turn", () => {
  it("the engine's error message and the turn's end are marked failed, live and in the transcript", () => {
    let out = ""
    const r = new EventRenderer((s) => (out += s))
    const failed: Protocol.AgentMessage = { id: "e", role: "assistant", content: "Error: boom", isError: true, timestamp: 0 }
    const events: Array<Protocol.AgentEvent> = [
      { type: "message_start", message: { id: "a", role: "assistant", content: "", timestamp: 0 } },
      { type: "message_update", messageId: "a", delta: "partial" },
      { type: "message_end", message: { id: "a", role: "assistant", content: "partial", timestamp: 0 } },
      { type: "message_start", message: { ...failed, content: "" } },
      { type: "message_update", messageId: "e", delta: "Error: boom" },
      { type: "message_end", message: failed },
      { type: "turn_end" },
      { type: "agent_end", error: { code: "http_status", message: "boom", status: 500 } }
    ]
    for (const e of events) r.event(e)
    assert.strictEqual(out, "partial\n[turn failed] Error: boom\n-- turn failed (http_status) --\n")
    let log = ""
    new EventRenderer((s) => (log += s)).message(failed)
    assert.strictEqual(log, "[turn failed] Error: boom\n")
  })
})

describe("the one-shot commands' connection (plain node:net) against a scripted peer", () => {
  const HELLO = { type: "daemon_hello", protocol: { name: "agentd", version: 1 }, clientId: "c1", supervisorGeneration: 3, supervisorPid: 42 }

  /** A socket in a fresh 0700 dir whose peer runs `script` on each connection; closed after the test. */
  const peer = async (script: (socket: net.Socket, lines: Array<unknown>) => void): Promise<string> => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-cli-peer-"))
    const socketPath = path.join(dir, "peer.sock")
    const server = net.createServer((socket) => {
      const lines: Array<unknown> = []
      let buffered = ""
      socket.on("data", (d) => {
        buffered += d.toString("utf8")
        let nl: number
        while ((nl = buffered.indexOf("\n")) >= 0) {
          lines.push(JSON.parse(buffered.slice(0, nl)))
          buffered = buffered.slice(nl + 1)
          script(socket, lines)
        }
      })
      socket.on("error", () => {})
      script(socket, lines)
    })
    await new Promise<void>((resolve) => server.listen(socketPath, resolve))
    onTestFinished(async () => {
      await new Promise<void>((resolve) => server.close(() => resolve()))
      fs.rmSync(dir, { recursive: true, force: true })
    })
    return socketPath
  }

  const failure = async (p: Promise<unknown>) => {
    const e = await p.then(() => assert.fail("expected a failure"), (e: unknown) => e)
    assert.isTrue(isCliError(e), String(e))
    return e as CliError
  }

  it("a response's data; the hello and a response split across chunks, other messages and ids skipped", async () => {
    const socketPath = await peer((socket, lines) => {
      if (lines.length === 0) {
        const hello = JSON.stringify(HELLO)
        socket.write(hello.slice(0, 10))
        setTimeout(() => socket.write(`${hello.slice(10)}\r\n\n`), 5)
        return
      }
      const command = lines.at(-1) as { id: string; command: { type: string } }
      assert.deepStrictEqual(Object.keys(command).sort(), ["command", "id", "protocol", "type"])
      socket.write(`{"type":"session_event"}\n{"type":"response","id":"other","success":true,"data":{}}\n`)
      const response = JSON.stringify({ type: "response", id: command.id, command: command.command.type, success: true, data: { n: lines.length } })
      socket.write(response.slice(0, 7))
      setTimeout(() => socket.write(`${response.slice(7)}\n`), 5)
    })
    const c = await connect(socketPath)
    try {
      assert.deepStrictEqual(c.hello, { supervisorGeneration: 3, supervisorPid: 42 })
      assert.deepStrictEqual(await c.request({ type: "status" }), { n: 1 })
      assert.deepStrictEqual(await c.request({ type: "list" }), { n: 2 })
    } finally {
      c.close()
    }
  })

  it("an error response fails with the daemon's message (exit 1), and the connection stays usable", async () => {
    const socketPath = await peer((socket, lines) => {
      if (lines.length === 0) return void socket.write(`${JSON.stringify(HELLO)}\n`)
      const { id } = lines.at(-1) as { id: string }
      socket.write(
        `${
          JSON.stringify(
            lines.length === 1
              ? { type: "response", id, command: "kill", success: false, error: { code: "session_not_found", message: "No session `x`." } }
              : { type: "response", id, command: "ping", success: true, data: { pong: true } }
          )
        }\n`
      )
    })
    await withConnection(socketPath, async (c) => {
      const e = await failure(c.request({ type: "kill", activeSessionId: "x" }))
      assert.strictEqual(e.message, "No session `x`.")
      assert.strictEqual(e.exitCode, EXIT.failed)
      assert.deepStrictEqual(await c.request({ type: "ping" }), { pong: true })
    })
  })

  it("not reachable (exit 3): nothing listens, the peer closes before its hello or before the response", async () => {
    const none = await failure(connect(path.join(os.tmpdir(), `agentd-none-${process.pid}.sock`)))
    assert.strictEqual(none.exitCode, EXIT.unreachable)
    assert.include(none.message, "no daemon listens at")
    assert.include(none.message, "no socket file there: ENOENT")
    assert.include(none.message, "agentd serve --detach")

    const silent = await peer((socket) => socket.end())
    const early = await failure(connect(silent))
    assert.strictEqual(early.exitCode, EXIT.unreachable)
    assert.include(early.message, "closed before the daemon's hello")

    const closing = await peer((socket, lines) => {
      if (lines.length === 0) socket.write(`${JSON.stringify(HELLO)}\n`)
      else socket.destroy()
    })
    const c = await connect(closing)
    const cut = await failure(c.request({ type: "status" }))
    assert.strictEqual(cut.exitCode, EXIT.unreachable)
    assert.strictEqual(cut.message, "the daemon closed the connection")
    // Later requests fail the same way at once.
    assert.strictEqual((await failure(c.request({ type: "status" }))).message, "the daemon closed the connection")
  })

  it("another protocol, or something that is not a daemon, is refused (exit 1)", async () => {
    const other = await peer((socket) => socket.write(`${JSON.stringify({ ...HELLO, protocol: { name: "agentd", version: 2 } })}\n`))
    const e = await failure(connect(other))
    assert.strictEqual(e.exitCode, EXIT.failed)
    assert.include(e.message, `speaks protocol {"name":"agentd","version":2}`)

    const notJson = await peer((socket) => socket.write("SSH-2.0-OpenSSH\n"))
    assert.include((await failure(connect(notJson))).message, "not JSON")

    const notHello = await peer((socket) => socket.write(`{"type":"response"}\n`))
    assert.include((await failure(connect(notHello))).message, "did not greet with daemon_hello")
  })
})

describe("what the command line says", () => {
  it("daemon errors name the command line's commands, not the protocol's", () => {
    const table: Array<[string, string, ReadonlyArray<string>, ReadonlyArray<string>]> = [
      ["session_failed", "Session `s-1` has failed; use retry_worker.", ["`agentd retry s-1`", "has failed."], ["retry_worker"]],
      ["session_busy", "Session `s-1` is running a turn.", ["`agentd abort s-1`", "`agentd attach s-1`"], []],
      ["session_damaged", "Session `s-1` is damaged (x). What can be read is shown.", ["`agentd log s-1`", "`agentd retry s-1`", "`agentd kill s-1`"], ["What can be read"]],
      ["session_not_found", "No session `x`.", ["No session `x`."], ["agentd"]]
    ]
    for (const [code, message, has, hasNot] of table) {
      const text = daemonErrorText(code, message)
      for (const h of has) assert.include(text, h, `${code}: ${text}`)
      for (const h of hasNot) assert.notInclude(text, h, `${code}: ${text}`)
    }
  })

  it("no daemon: the errno in words, and how to start one where that helps", () => {
    assert.strictEqual(
      noDaemonText("/s.sock", "ENOENT"),
      "no daemon listens at /s.sock (no socket file there: ENOENT); start one with `agentd serve --detach`"
    )
    assert.include(noDaemonText("/s.sock", "ECONNREFUSED"), "nothing listening on it: ECONNREFUSED); start one")
    assert.strictEqual(noDaemonText("/s.sock", "EACCES"), "no daemon listens at /s.sock (permission denied: EACCES)")
    assert.strictEqual(noDaemonText("/s.sock", "EWHATEVER"), "no daemon listens at /s.sock (EWHATEVER)")
  })

  it("counts: singular for one, plural otherwise", () => {
    assert.deepStrictEqual([0, 1, 2].map((n) => count(n, "session")), ["0 sessions", "1 session", "2 sessions"])
  })

  it("a transcript message as log shows it: tool calls with their arguments, failed tools and turns, a cut message marked", () => {
    const at = { id: "m", timestamp: 0 }
    const table: Array<[Protocol.AgentMessage, string]> = [
      [{ ...at, role: "user", content: "hi\nthere" }, "> hi\n> there\n"],
      [{ ...at, role: "assistant", content: "hello" }, "hello\n"],
      [{ ...at, role: "tool", content: "slept 10 ms", toolCallId: "c1", toolName: "sleep", toolArgs: { ms: 10 } }, '[tool sleep {"ms":10}]\n[tool sleep -> slept 10 ms]\n'],
      [{ ...at, role: "tool", content: "no such file", toolName: "read", toolArgs: { path: "x" }, isError: true }, '[tool read {"path":"x"}]\n[tool read failed no such file]\n'],
      [{ ...at, role: "tool", content: "r", toolName: "t" }, "[tool t -> r]\n"],
      [{ ...at, role: "assistant", content: "rate limited", isError: true }, "[turn failed] rate limited\n"],
      [{ ...at, role: "assistant", content: "half a sen", interrupted: true }, "half a sen\n-- turn interrupted --\n"],
      [{ ...at, role: "assistant", content: "", interrupted: true }, "-- turn interrupted --\n"]
    ]
    for (const [m, expected] of table) assert.strictEqual(message(m), expected, JSON.stringify(m))
  })
})
