/**
 * `agentd attach` on a terminal takes input (docs/protocol.md section 8), driven through a real
 * pseudo-terminal (python3's pty module: test/support/ptyBridge.py): Enter sends a prompt, a
 * prompt during a turn is refused with the reason, Ctrl-C aborts a running turn, `/checkpoint`
 * and `/log`, what is typed during a streamed turn is neither echoed into the stream nor lost,
 * Ctrl-C when idle and Ctrl-D detach (exit 0); `--read-only` takes no input.
 *
 * Needs `npm run build` first.
 */
import { type ChildProcess, spawn } from "node:child_process"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { assert, describe, it, onTestFinished } from "vitest"
import { runCli, until } from "./cliRun.js"
import { cleanUpAfterTests, DAEMON_BIN, sharedDaemon, sleep } from "./harness.js"

cleanUpAfterTests()

const BRIDGE = path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "support", "ptyBridge.py")

/** `agentd ARGS` on a pseudo-terminal of 100 columns: keys in, the raw screen output out. */
class Terminal {
  output = ""
  readonly exited: Promise<number | null>
  private readonly proc: ChildProcess

  constructor(args: ReadonlyArray<string>) {
    this.proc = spawn("python3", [BRIDGE, "100", "30", process.execPath, DAEMON_BIN, ...args], {
      stdio: ["pipe", "pipe", "pipe"],
      env: { ...Object.fromEntries(Object.entries(process.env).filter(([k]) => !k.startsWith("AGENTD_") && k !== "NO_COLOR")), TERM: "xterm" }
    })
    this.proc.stdout!.setEncoding("utf8").on("data", (d: string) => (this.output += d))
    this.proc.stderr!.setEncoding("utf8").on("data", (d: string) => (this.output += d))
    this.exited = new Promise((resolve) => this.proc.once("exit", (code) => resolve(code)))
    onTestFinished(() => {
      if (this.proc.exitCode === null && this.proc.signalCode === null) {
        this.proc.kill("SIGTERM")
        setTimeout(() => this.proc.kill("SIGKILL"), 500).unref()
      }
    })
  }

  keys(s: string): void {
    this.proc.stdin!.write(s)
  }

  /** Waits until the output after `from` matches. */
  async see(pattern: RegExp | string, from = 0): Promise<number> {
    const found = () => {
      const rest = this.output.slice(from)
      const at = typeof pattern === "string" ? rest.indexOf(pattern) : rest.search(pattern)
      return at === -1 ? -1 : from + at
    }
    await until(`${String(pattern)} on the terminal; it shows:\n${JSON.stringify(this.output.slice(-2000))}`, () => found() !== -1)
    return found()
  }

  async exit(): Promise<number | null> {
    return await Promise.race([this.exited, sleep(10_000).then(() => "timeout" as const)]).then((code) => {
      if (code === "timeout") throw new Error(`attach did not exit; it shows:\n${JSON.stringify(this.output.slice(-2000))}`)
      return code
    })
  }
}

describe("interactive attach on a terminal (e2e, pty)", () => {
  const daemon = sharedDaemon()

  it("Enter prompts, busy refused, Ctrl-C aborts, /checkpoint, /log, typing kept apart from a streamed turn, Ctrl-C detaches", async () => {
    const s = ["--socket", daemon().socketPath]
    const name = `tty-${Date.now()}`
    const created = await runCli(["create", "--name", name, "--set", "tokenDelayMs=15", ...s])
    assert.strictEqual(created.code, 0, created.stderr)
    const t = new Terminal(["attach", name, ...s])
    let at = await t.see("\x1b[0J> ") // the input line

    t.keys("hello there\r")
    at = await t.see("echo: hello there\r\n", at)
    at = await t.see("-- turn ended --", at)

    t.keys("/sleep 5000\r")
    at = await t.see("[tool sleep", at)
    t.keys("too soon\r")
    at = await t.see("a turn is running", at)
    t.keys("\x03") // Ctrl-C during the turn: abort
    at = await t.see("turn interrupted (aborted)", at)

    t.keys("/checkpoint\r")
    at = await t.see(/checkpoint: generation \d+/, at)
    t.keys("/log 2\r")
    at = await t.see("--- the last 2 messages ---", at)
    at = await t.see("----- live -----", at)

    // Typing during a turn another client runs: the streamed reply comes out whole, and what
    // was typed is shown again, whole, once the turn is over.
    at = await t.see("\x1b[0J> ", at)
    t.keys("dra")
    const other = runCli(["prompt", name, "one two three four five six", ...s])
    const turnAt = await t.see("> one two three four five six\r\n", at)
    t.keys("ft")
    const reply = "echo: one two three four five six\r\n"
    const streamed = await t.see(reply, turnAt)
    assert.strictEqual((await other).code, 0)
    // The reply came out whole (the match above) and nothing typed came out inside the turn.
    const turn = t.output.slice(turnAt, streamed + reply.length)
    assert.notMatch(turn, /dra|ft/, "typed text came out inside the turn")
    at = await t.see(/> dra(\x1b\[\d+G)?ft/, streamed)

    t.keys("\x15") // Ctrl-U: clear the line
    t.keys("\x03") // Ctrl-C when idle: detach
    assert.strictEqual(await t.exit(), 0, t.output)
    const log = await runCli(["log", name, "--json", ...s])
    const contents = (JSON.parse(log.stdout).messages as Array<{ content: string }>).map((m) => m.content)
    assert.includeMembers(contents, ["hello there", "echo: hello there", "/sleep 5000", "one two three four five six"])
    assert.notInclude(contents, "too soon")
    assert.notInclude(contents, "draft")

    // Ctrl-D detaches too; --read-only takes no input (Enter sends nothing, Ctrl-C ends it: 130).
    const t2 = new Terminal(["attach", name, ...s])
    // The input line is drawn once the terminal is in raw mode: a key before it may be lost.
    await t2.see("\x1b[0J> ", await t2.see("----- live -----"))
    t2.keys("\x04")
    assert.strictEqual(await t2.exit(), 0, t2.output)
    const t3 = new Terminal(["attach", name, "--read-only", ...s])
    await t3.see("----- live -----")
    t3.keys("not a prompt\r")
    await sleep(300)
    t3.keys("\x03")
    assert.strictEqual(await t3.exit(), 130, t3.output)
    const after = await runCli(["log", name, "--json", ...s])
    assert.notInclude(after.stdout, "not a prompt")
  })
})
