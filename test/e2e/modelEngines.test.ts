/**
 * A model engine through the real daemon (the built `agentd serve`) and real workers: an
 * `openai-compat` session against a fake chat-completions server on 127.0.0.1 runs a tool-call
 * turn, a 429 then success, an abort mid-stream (the server sees the request closed), a
 * SIGKILL of its worker mid-stream, and a 401; then the API key is nowhere in the state dir or
 * the daemon's log, whether it came from the daemon's environment or from `launchEnv`. Failed
 * turns: an endpoint that answers 500 or 401, sends a malformed or cut stream, stalls after a
 * few bytes (idleTimeoutMs), or is down: `agentd prompt` exits 1 with the error on stderr and
 * the partial text on stdout, the turn's `agent_end` carries the error (through replay and a
 * daemon restart), the error message keeps `isError`, and the SDK's `prompt` throws `TurnFailed`.
 */
import { spawn } from "node:child_process"
import * as fs from "node:fs"
import * as path from "node:path"
import { afterEach, describe, expect, it, onTestFinished } from "vitest"
import * as AgentdClient from "../../src/client.js"
import { anthropic, chat, type FakeModel, type Reply as FakeModelReply, responses, startFakeModel, type Step } from "../support/fakeModels.js"
import {
  agentMessageProblems,
  allMessages,
  cleanUpAfterTests,
  collectTurn,
  collectUntil,
  createSession,
  DAEMON_BIN,
  isEvent,
  type Msg,
  useDaemon,
  waitIdle
} from "./harness.js"

cleanUpAfterTests()

const KEY = "sk-e2e-daemon-key-7f3a9c1e5b"
const LAUNCH_KEY = "sk-e2e-launch-key-2d8b6f0a4c"

let fake: FakeModel | undefined
afterEach(async () => {
  await fake?.close()
  fake = undefined
})

/** Every file under `dir` whose bytes contain `needle`. */
const filesContaining = (dir: string, needle: string): Array<string> => {
  const out: Array<string> = []
  const walk = (d: string) => {
    for (const entry of fs.readdirSync(d, { withFileTypes: true })) {
      const p = path.join(d, entry.name)
      if (entry.isDirectory()) walk(p)
      else if (entry.isFile() && fs.readFileSync(p).includes(needle)) out.push(p)
    }
  }
  walk(dir)
  return out
}

/** Runs `agentd ARGS` (the built CLI) to its end; killed when the test finishes if it still runs. */
const cli = (args: ReadonlyArray<string>) => {
  const proc = spawn(process.execPath, [DAEMON_BIN, ...args], {
    stdio: ["ignore", "pipe", "pipe"],
    env: { ...Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("AGENTD_"))), NO_COLOR: "" }
  })
  onTestFinished(() => {
    if (proc.exitCode === null && proc.signalCode === null) proc.kill("SIGKILL")
  })
  let stdout = ""
  let stderr = ""
  proc.stdout!.setEncoding("utf8").on("data", (d: string) => (stdout += d))
  proc.stderr!.setEncoding("utf8").on("data", (d: string) => (stderr += d))
  return new Promise<{ code: number | null; stdout: string; stderr: string }>((resolve, reject) => {
    proc.once("error", reject)
    proc.once("close", (code) => resolve({ code, stdout, stderr }))
  })
}

const waitClosed = async (f: FakeModel, index: number) => {
  await Promise.race([f.requests[index]!.done, new Promise((resolve) => setTimeout(resolve, 5000))])
  return f.requests[index]!.closedEarly
}

describe("model engines (e2e)", () => {
  it("openai-compat through the daemon: tools, 429, abort, worker SIGKILL, 401; the key is never written", async () => {
    fake = await startFakeModel()
    const daemon = await useDaemon({ env: { OPENAI_API_KEY: KEY } })
    const client = await daemon.connect()
    const config = { model: "fake-model", baseUrl: `${fake.url}/v1`, retryBaseDelayMs: 10 }
    const { id } = await createSession(client, { engine: "openai-compat", config })
    await waitIdle(client, id)
    await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })

    // The tools work in the session's own work dir.
    const workDir = path.join(daemon.stateDir, "sessions", id, "work")
    expect(fs.statSync(workDir).isDirectory()).toBe(true)
    expect(fs.statSync(workDir).mode & 0o777).toBe(0o700)
    fs.writeFileSync(path.join(workDir, "notes.txt"), "the word is kumquat")

    // 1. A tool-call round trip.
    fake.reply({ steps: chat.toolCall("call_1", "read_file", { path: "notes.txt" }) }, { steps: chat.text(["The word ", "is kumquat."]) })
    await client.ok({ type: "prompt", activeSessionId: id, message: "what is the word?" })
    const first = await collectTurn(client, id, 20_000)
    const events = first.filter((m) => m["type"] === "session_event").map((m) => m["event"])
    expect(events.find((e) => e.type === "tool_execution_end")).toEqual({
      type: "tool_execution_end",
      toolCallId: "call_1",
      result: "the word is kumquat",
      isError: false
    })
    expect(events.filter((e) => e.type === "message_update").map((e) => e.delta).join("")).toBe("The word is kumquat.")
    expect(fake.requests[0]!.headers["authorization"]).toBe(`Bearer ${KEY}`)
    expect(JSON.stringify(fake.requests[1]!.body)).toContain("the word is kumquat")

    // 2. A 429 with retry-after, then success.
    fake.reply({ status: 429, headers: { "retry-after": "0" }, body: { error: { message: "rate limited" } } }, { steps: chat.text(["after ", "retry"]) })
    await client.ok({ type: "prompt", activeSessionId: id, message: "again" })
    const second = await collectTurn(client, id, 20_000)
    expect(second.some(isEvent("agent_end"))).toBe(true)
    expect(fake.requests).toHaveLength(4)
    // The whole conversation went with it, the tool call included.
    expect(JSON.stringify(fake.requests[3]!.body.messages)).toContain("call_1")

    // 3. An abort mid-stream: the turn is interrupted and the server sees the request closed.
    fake.reply({ steps: chat.hang(["partial ", "text"]) })
    await client.ok({ type: "prompt", activeSessionId: id, message: "long one" })
    await collectUntil(client, id, isEvent("message_update"), 20_000)
    const aborted = await client.ok({ type: "abort", activeSessionId: id })
    expect(aborted["aborted"]).toBe(true)
    const third = await collectTurn(client, id, 20_000)
    expect(third.find(isEvent("turn_interrupted"))!["event"].reason).toBe("aborted")
    const cut = third.filter(isEvent("message_end")).at(-1)!["event"].message
    expect([cut.role, cut.content, cut.interrupted]).toEqual(["assistant", "partial text", true])
    expect(await waitClosed(fake, 4)).toBe(true)

    // 4. The worker SIGKILLed mid-stream: turn_interrupted, a new worker, the request closed.
    fake.reply({ steps: chat.hang(["doomed"]) })
    await client.ok({ type: "prompt", activeSessionId: id, message: "crash now" })
    await collectUntil(client, id, isEvent("message_update"), 20_000)
    const pid = (await client.ok({ type: "get_state", activeSessionId: id }))["workerPid"] as number
    daemon.recordedWorkerPids.add(pid)
    process.kill(pid, "SIGKILL")
    const rest = await collectUntil(client, id, (m) => m["type"] === "session_status" && m["state"].worker === "ready", 20_000)
    expect(rest.find(isEvent("turn_interrupted"))!["event"].reason).toBe("worker_crashed")
    expect(await waitClosed(fake, 5)).toBe(true)

    // 5. A 401 (its body echoing the key): the turn ends with an error message, without the key.
    fake.reply({ status: 401, body: { error: { message: `Incorrect API key provided: ${KEY}` } } })
    await client.ok({ type: "prompt", activeSessionId: id, message: "after the crash" })
    const fifth = await collectTurn(client, id, 20_000)
    const failed = fifth.filter(isEvent("message_end")).map((m) => m["event"].message).at(-1)
    expect(failed.isError).toBe(true)
    expect(failed.content).toContain("401")
    expect(failed.content).toContain("OPENAI_API_KEY")

    // The session is still there and answers.
    fake.reply({ steps: chat.text(["still ", "here"]) })
    await client.ok({ type: "prompt", activeSessionId: id, message: "ok?" })
    await collectTurn(client, id, 20_000)
    const transcript = await allMessages(client, id)
    expect(transcript.at(-1)!["content"]).toBe("still here")
    expect(transcript.filter((m) => m["role"] === "tool")).toHaveLength(1)
    for (const m of transcript) expect(agentMessageProblems(m)).toEqual([])
    // The text streamed before the abort and before the crash stayed, marked interrupted.
    expect(transcript.filter((m) => m["interrupted"] === true).map((m) => m["content"])).toEqual(["partial text", "doomed"])

    // A second session gets its key from create's launchEnv instead.
    const launched = await createSession(client, { engine: "openai-compat", config, launchEnv: { OPENAI_API_KEY: LAUNCH_KEY } })
    await waitIdle(client, launched.id)
    await client.ok({ type: "attach", activeSessionId: launched.id, capabilities: ["event_sequence", "slim_attach"] })
    fake.reply({ steps: chat.text(["hello"]) })
    await client.ok({ type: "prompt", activeSessionId: launched.id, message: "hi" })
    await collectTurn(client, launched.id, 20_000)
    expect(fake.requests.at(-1)!.headers["authorization"]).toBe(`Bearer ${LAUNCH_KEY}`)

    // Checkpoints and a clean stop write everything there is to write.
    await client.ok({ type: "checkpoint", activeSessionId: id })
    await client.ok({ type: "checkpoint", activeSessionId: launched.id })
    await client.ok({ type: "shutdown" })
    await daemon.exited
    for (const key of [KEY, LAUNCH_KEY]) {
      expect(filesContaining(daemon.stateDir, key)).toEqual([])
      expect(daemon.stderr).not.toContain(key)
      expect(daemon.stdout).not.toContain(key)
    }
    // What was written is really there (the grep looked at the right files).
    expect(filesContaining(daemon.stateDir, "kumquat").length).toBeGreaterThan(0)
  }, 90_000)

  for (
    const p of [
      {
        engine: "openai",
        env: "OPENAI_API_KEY",
        baseUrl: (f: FakeModel) => `${f.url}/v1`,
        text: (d: Array<string>) => responses.text(d),
        hang: (d: Array<string>) => responses.text(d, { end: "hang" }),
        toolCall: (id: string, name: string, args: unknown): Array<Step> => responses.toolCall(id, name, args),
        key: (h: Record<string, unknown>) => h["authorization"]
      },
      {
        engine: "anthropic",
        env: "ANTHROPIC_API_KEY",
        baseUrl: (f: FakeModel) => f.url,
        text: (d: Array<string>) => anthropic.text(d),
        hang: (d: Array<string>) => anthropic.text(d, { end: "hang" }),
        toolCall: (id: string, name: string, args: unknown): Array<Step> => anthropic.toolCall(id, name, args),
        key: (h: Record<string, unknown>) => h["x-api-key"]
      }
    ] as const
  ) {
    it(`${p.engine} through the daemon: a tool call, 429 then success, an abort, a worker SIGKILL`, async () => {
      fake = await startFakeModel()
      const daemon = await useDaemon({ env: { [p.env]: KEY } })
      const client = await daemon.connect()
      const cwd = path.join(daemon.stateDir, "..", "project")
      fs.mkdirSync(cwd, { recursive: true })
      fs.writeFileSync(path.join(cwd, "notes.txt"), "the word is kumquat")
      const { id } = await createSession(client, {
        engine: p.engine,
        config: { model: "fake-model", baseUrl: p.baseUrl(fake), retryBaseDelayMs: 10, cwd }
      })
      await waitIdle(client, id)
      await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })

      fake.reply({ steps: p.toolCall("call_1", "read_file", { path: "notes.txt" }) }, { steps: p.text(["The word ", "is kumquat."]) })
      await client.ok({ type: "prompt", activeSessionId: id, message: "what is the word?" })
      const first = (await collectTurn(client, id, 20_000)).filter((m) => m["type"] === "session_event").map((m) => m["event"])
      expect(first.find((e) => e.type === "tool_execution_end")?.result).toBe("the word is kumquat")
      expect(first.filter((e) => e.type === "message_update").map((e) => e.delta).join("")).toBe("The word is kumquat.")
      expect(String(p.key(fake.requests[0]!.headers))).toContain(KEY)

      fake.reply({ status: 429, headers: { "retry-after": "0" }, body: { error: { message: "rate limited" } } }, { steps: p.text(["retried"]) })
      await client.ok({ type: "prompt", activeSessionId: id, message: "again" })
      const second = await collectTurn(client, id, 20_000)
      expect(second.filter(isEvent("message_end")).at(-1)!["event"].message.content).toBe("retried")

      fake.reply({ steps: p.hang(["partial"]) })
      await client.ok({ type: "prompt", activeSessionId: id, message: "long one" })
      await collectUntil(client, id, isEvent("message_update"), 20_000)
      await client.ok({ type: "abort", activeSessionId: id })
      expect((await collectTurn(client, id, 20_000)).find(isEvent("turn_interrupted"))!["event"].reason).toBe("aborted")
      expect(await waitClosed(fake, fake.requests.length - 1)).toBe(true)

      fake.reply({ steps: p.hang(["doomed"]) })
      await client.ok({ type: "prompt", activeSessionId: id, message: "crash now" })
      await collectUntil(client, id, isEvent("message_update"), 20_000)
      const pid = (await client.ok({ type: "get_state", activeSessionId: id }))["workerPid"] as number
      daemon.recordedWorkerPids.add(pid)
      process.kill(pid, "SIGKILL")
      const rest = await collectUntil(client, id, (m) => m["type"] === "session_status" && m["state"].worker === "ready", 20_000)
      expect(rest.find(isEvent("turn_interrupted"))!["event"].reason).toBe("worker_crashed")
      expect(await waitClosed(fake, fake.requests.length - 1)).toBe(true)

      fake.reply({ steps: p.text(["alive"]) })
      await client.ok({ type: "prompt", activeSessionId: id, message: "still there?" })
      await collectTurn(client, id, 20_000)
      expect((await allMessages(client, id)).at(-1)!["content"]).toBe("alive")
      await client.ok({ type: "shutdown" })
      await daemon.exited
      expect(filesContaining(daemon.stateDir, KEY)).toEqual([])
      expect(daemon.stderr).not.toContain(KEY)
    }, 90_000)
  }

  it("context compaction through the daemon: the client gets the summarized transcript as a replacement snapshot", async () => {
    fake = await startFakeModel()
    const daemon = await useDaemon()
    const client = await daemon.connect()
    const config = { model: "fake-model", baseUrl: `${fake.url}/v1`, maxContextTokens: 200 }
    const { id } = await createSession(client, { engine: "openai-compat", config })
    await waitIdle(client, id)
    await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    const long = (w: string) => `${w} `.repeat(150)
    fake.reply({ steps: chat.text([long("first-answer")]) })
    await client.ok({ type: "prompt", activeSessionId: id, message: long("first-question") })
    await collectTurn(client, id, 20_000)

    // The second turn is over the budget: a summary request, then the turn over the new transcript.
    const mark = client.all.length
    fake.reply({ steps: chat.text(["They talked about the first question."]) }, { steps: chat.text(["second answer"]) })
    await client.ok({ type: "prompt", activeSessionId: id, message: "second question" })
    await collectTurn(client, id, 20_000)
    const seen = client.all.slice(mark).filter((m) => m["activeSessionId"] === id)
    const begin = seen.find((m) => m["type"] === "session_snapshot_begin")
    expect(begin?.["purpose"]).toBe("replacement")
    const replaced = seen.filter((m) => m["type"] === "session_snapshot_chunk").flatMap((c) => c["messages"])
    expect(replaced.map((m: any) => m.content)).toEqual([
      "Summary of the earlier conversation (2 messages):\nThey talked about the first question.",
      "second question"
    ])
    expect(fake.requests).toHaveLength(3)
    expect(JSON.stringify(fake.requests[2]!.body)).not.toContain("first-answer")
    const transcript = await allMessages(client, id)
    expect(transcript.map((m) => m["content"])).toEqual([replaced[0].content, "second question", "second answer"])
  }, 60_000)

  it("failed turns: 500, 401, a malformed or cut stream, a stall (idleTimeoutMs), a server down: prompt exits 1, agent_end.error, isError, through replay and a restart", async () => {
    fake = await startFakeModel()
    const daemon = await useDaemon()
    const client = await daemon.connect()
    const config = { model: "fake-model", baseUrl: `${fake.url}/v1`, retryBaseDelayMs: 10, maxRetries: 1, idleTimeoutMs: 500 }
    const { id } = await createSession(client, { engine: "openai-compat", config })
    await waitIdle(client, id)
    await client.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence", "slim_attach"] })
    const socket = ["--socket", daemon.socketPath]

    /** One prompt through the CLI, and the turn's events as the attached client saw them. */
    const prompt = async (sessionId: string, text: string) => {
      const run = await cli(["prompt", ...socket, sessionId, text])
      const events = (await collectTurn(client, sessionId, 20_000)).filter((m) => m["type"] === "session_event").map((m) => m["event"])
      return { ...run, events, end: events.find((e: Msg) => e.type === "agent_end") }
    }
    const cases: Array<{ name: string; reply: ReadonlyArray<FakeModelReply>; code: string; status?: number; partial?: string; says: string }> = [
      { name: "500", reply: [{ status: 500, body: { error: { message: "kaboom" } } }, { status: 500, body: { error: { message: "kaboom" } } }], code: "http_status", status: 500, says: "kaboom" },
      { name: "401", reply: [{ status: 401, body: { error: { message: "bad key" } } }], code: "auth", status: 401, says: "OPENAI_API_KEY" },
      { name: "malformed SSE", reply: [{ steps: [...chat.text(["half "]).slice(0, 2), { sse: "{not json" }] }], code: "malformed_response", partial: "half ", says: "malformed" },
      { name: "cut stream", reply: [{ steps: chat.cut(["partial ", "text"]) }], code: "stream_cut", partial: "partial text", says: "cut" },
      { name: "stall", reply: [{ steps: chat.stall(["slow ", "start"]) }], code: "timeout", partial: "slow start", says: "idleTimeoutMs" }
    ]
    for (const c of cases) {
      fake.reply(...c.reply)
      const r = await prompt(id, `case ${c.name}`)
      expect(r.code, `${c.name}: ${r.stderr}`).toBe(1)
      expect(r.stderr, c.name).toContain(`the turn failed (${c.code})`)
      expect(r.stderr, c.name).toContain(c.says)
      // The partial text on stdout, the error message not.
      expect(r.stdout, c.name).toBe(c.partial === undefined ? "" : `${c.partial}\n`)
      expect(r.end?.error?.code, c.name).toBe(c.code)
      expect(r.end?.error?.status, c.name).toBe(c.status)
      const transcript = await allMessages(client, id)
      const last = transcript.at(-1)!
      expect([last["role"], last["isError"]], c.name).toEqual(["assistant", true])
      expect(last["content"], c.name).toBe(`Error: ${r.end.error.message}`)
      if (c.partial !== undefined) expect(transcript.at(-2)!["content"], c.name).toBe(c.partial)
    }
    // `agentd log` marks the error messages apart from the model's answers.
    const log = await cli(["log", ...socket, id])
    expect(log.code).toBe(0)
    expect(log.stdout.split("\n").filter((l) => l.startsWith("[turn failed] Error: "))).toHaveLength(cases.length)
    expect(log.stdout).toContain("\nslow start\n")

    // The stalled request was given up on (closed), and the session answers again.
    expect(await waitClosed(fake, fake.requests.length - 1)).toBe(true)
    fake.reply({ steps: chat.text(["fine ", "again"]) })
    const ok = await prompt(id, "still there?")
    expect([ok.code, ok.stdout, ok.stderr]).toEqual([0, "fine again\n", ""])
    expect(ok.end).toEqual({ type: "agent_end" })

    // A server down.
    const down = await startFakeModel()
    await down.close()
    const { id: downId } = await createSession(client, { engine: "openai-compat", config: { ...config, baseUrl: `${down.url}/v1` } })
    await waitIdle(client, downId)
    await client.ok({ type: "attach", activeSessionId: downId, capabilities: ["event_sequence", "slim_attach"] })
    const refused = await prompt(downId, "anyone?")
    expect(refused.code).toBe(1)
    expect(refused.stderr).toContain("the turn failed (connect_failed)")
    expect(refused.stdout).toBe("")
    expect(refused.end?.error?.code).toBe("connect_failed")

    // The SDK: promptTurn (under the Promise facade) throws TurnFailed after the agent_end.
    const sdk = await AgentdClient.connect({ socketPath: daemon.socketPath })
    try {
      fake.reply({ status: 503, body: { error: { message: "busy" } } }, { status: 503, body: { error: { message: "busy" } } })
      const seen: Array<string> = []
      let thrown: unknown
      try {
        for await (const e of sdk.session(id).prompt("via the sdk")) seen.push(e.type)
      } catch (e) {
        thrown = e
      }
      expect(seen.at(-1)).toBe("agent_end")
      expect(thrown).toBeInstanceOf(AgentdClient.TurnFailed)
      expect([(thrown as AgentdClient.TurnFailed).code, (thrown as AgentdClient.TurnFailed).status]).toEqual(["http_status", 503])
      expect((thrown as AgentdClient.TurnFailed).message).toContain("busy")
      await collectTurn(client, id, 20_000)
    } finally {
      await sdk.close()
    }

    // Through a checkpoint and a daemon restart: get_messages, the attach baseline and a resume
    // replay keep isError and agent_end.error.
    const before = await allMessages(client, id)
    const failedIds = before.filter((m) => m["isError"] === true).map((m) => m["id"])
    expect(failedIds).toHaveLength(cases.length + 1)
    await client.ok({ type: "checkpoint", activeSessionId: id })
    await client.ok({ type: "shutdown" })
    await daemon.exited
    const again = await useDaemon({ stateDir: daemon.stateDir })
    const c2 = await again.connect()
    const after = await allMessages(c2, id)
    expect(after).toEqual(before)
    for (const m of after) expect(agentMessageProblems(m)).toEqual([])
    const baseline = await c2.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence"] })
    expect(baseline["messages"].filter((m: Msg) => m["isError"] === true).map((m: Msg) => m["id"])).toEqual(failedIds)
    await c2.ok({ type: "detach", activeSessionId: id })
    const c3 = await again.connect()
    const replay = await c3.ok({ type: "attach", activeSessionId: id, capabilities: ["event_sequence"], resumeCursor: { generation: 1, sequence: 0 } })
    expect(replay["replay"].status).toBe("complete")
    const ends = (await collectUntil(c3, id, (m) => isEvent("agent_end")(m) && m["event"].error?.code === "http_status" && m["event"].error?.status === 503, 20_000))
      .filter(isEvent("agent_end"))
      .map((m) => m["event"].error?.code ?? "ok")
    expect(ends).toEqual([...cases.map((c) => c.code), "ok", "http_status"])
  }, 120_000)

  it("create refuses a bad model-engine config with invalid_command naming the field", async () => {
    const daemon = await useDaemon()
    const client = await daemon.connect()
    const response = await client.request({ type: "create", engine: "openai-compat", config: { baseUrl: "http://127.0.0.1:9/v1" } })
    expect(response["success"]).toBe(false)
    expect(response["error"].code).toBe("invalid_command")
    expect(response["error"].message).toContain("config.model")
  }, 60_000)
})
