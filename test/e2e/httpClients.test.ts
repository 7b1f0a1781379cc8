/**
 * Clients over the network (docs/protocol.md section 10): the command line with `--url` and the
 * SDK's Promise client with `url`, through the HTTP front's `/v1/socket` WebSocket, against the
 * built daemon. They resume across a daemon SIGKILL and restart on the same port with no gap and
 * no duplicate; a wrong token, a refused Host, an Origin refusal, a bad URL and a port with
 * nothing on it each get a clear error (and the exit code of section 8).
 */
import * as http from "node:http"
import { assert, describe, it } from "vitest"
import * as Client from "../../src/client.js"
import { runCli, startCli, until } from "./cliRun.js"
import { cleanUpAfterTests, cursorGap, isSequenced, type Msg } from "./harness.js"
import { freePort, useHttpDaemon } from "./httpHarness.js"

cleanUpAfterTests()

const jsonLines = (text: string): Array<Msg> =>
  text.split("\n").filter((l) => l.startsWith("{")).map((l) => JSON.parse(l) as Msg)

const ends = (msgs: ReadonlyArray<Msg>) => msgs.filter((m) => m["type"] === "session_event" && m["event"]?.type === "agent_end").length

describe("clients over --url / url (e2e)", () => {
  it("CLI create/sessions/prompt/attach and the Promise client over the WebSocket, across a daemon SIGKILL and restart on the same port", async () => {
    const port = await freePort()
    const first = await useHttpDaemon({ port })
    const { url, token } = first
    const stateDir = first.daemon.stateDir
    // The token from the state dir (a loopback URL), then from AGENTD_TOKEN.
    const created = await runCli(["create", "--name", "net", "--url", url, "--state-dir", stateDir])
    assert.strictEqual(created.code, 0, created.stderr)
    const id = created.stdout.trim()
    const env = { AGENTD_TOKEN: token }
    const viaEnv = (args: ReadonlyArray<string>) => runCli([...args, "--url", url], { env })
    // AGENTD_URL works as --url does.
    const listed = await runCli(["sessions", "--json"], { env: { ...env, AGENTD_URL: url } })
    assert.strictEqual(listed.code, 0, listed.stderr)
    assert.deepStrictEqual(JSON.parse(listed.stdout).sessions.map((s: Msg) => s["activeSessionId"]), [id])
    const one = await viaEnv(["prompt", "net", "one"])
    assert.strictEqual(one.code, 0, one.stderr)
    assert.strictEqual(one.stdout, "echo: one\n")

    const att = startCli(["attach", "net", "--json", "--url", url, "--reconnect-timeout", "30"], { env })
    await until("attach's baseline", () => att.stdout.includes('"type":"baseline"'), 15_000)

    // The Promise client over ws: a prompt, and a follow that outlives the daemon.
    const client = await Client.connect({ url, token })
    assert.strictEqual(client.socketPath, url)
    const replies: Array<string> = []
    for await (const e of client.session(id).prompt("two")) if (e.type === "message_update") replies.push(e.delta)
    assert.strictEqual(replies.join(""), "echo: two")
    const followed: Array<Msg> = []
    const follow = (async () => {
      for await (const e of client.session(id).follow()) {
        followed.push(e as Msg)
        if (ends(followed) >= 3) return
      }
    })()
    await until("attach sees turn two", () => ends(jsonLines(att.stdout)) >= 1, 15_000)

    await first.daemon.sigkill()
    await until("attach notices the loss", () => att.stderr.includes("lost the daemon"), 15_000)
    const second = await useHttpDaemon({ port, stateDir })
    await until("attach notices the restart", () => att.stderr.includes("the daemon restarted"), 20_000)
    const three = await viaEnv(["prompt", "net", "three"])
    assert.strictEqual(three.code, 0, three.stderr)
    assert.strictEqual(three.stdout, "echo: three\n")
    await until("attach sees turn three", () => att.stdout.includes("echo: three"), 15_000)
    await until("attach sees turn three end", () => ends(jsonLines(att.stdout)) >= 2, 15_000)

    // Every sequenced message once, in cursor order, across the restart.
    const seen = jsonLines(att.stdout).filter(isSequenced)
    assert.isUndefined(cursorGap(seen), cursorGap(seen))
    // The follower started after turn one: it sees turns two and three, and the history it
    // attached with as its baseline; its cursors too follow on without a gap.
    await follow
    const followedSequenced = followed.filter(isSequenced)
    assert.isUndefined(cursorGap(followedSequenced), cursorGap(followedSequenced))
    await client.close()

    const state = await viaEnv(["state", "net", "--json"])
    assert.strictEqual(JSON.parse(state.stdout).messageCount, 6)
    att.proc.kill("SIGINT")
    await att.done
    await second.daemon.stop("SIGTERM")
  }, 90_000)

  it("refusals: a wrong token (401, says `agentd http-token`, not retried), a refused Host (421), Origin (403), a bad URL (exit 2), nothing listening (exit 3)", async () => {
    const h = await useHttpDaemon()
    const wrong = { AGENTD_TOKEN: "not-the-token" }
    for (const args of [["sessions"], ["attach", "x"]]) {
      const r = await runCli([...args, "--url", h.url], { env: wrong })
      assert.strictEqual(r.code, 3, `${args[0]}: ${r.stderr}`)
      assert.include(r.stderr, `the daemon at ${h.url} refused the token (401)`)
      assert.include(r.stderr, "`agentd http-token`")
      assert.notInclude(r.stderr, "not-the-token")
    }
    const rejected = await Client.connect({ url: h.url, token: "nope" }).then(() => undefined, (e: unknown) => e as Msg)
    assert.strictEqual(rejected?.["_tag"], "DaemonUnreachable")
    assert.strictEqual(rejected?.["status"], 401)

    const bad = await runCli(["sessions", "--url", "ftp://127.0.0.1:1"])
    assert.strictEqual(bad.code, 2)
    assert.include(bad.stderr, "the URL scheme must be http, https, ws or wss")
    const withCredentials = await runCli(["sessions", "--url", "http://user:secret@127.0.0.1:1"])
    assert.strictEqual(withCredentials.code, 2)
    assert.include(withCredentials.stderr, "no credentials in the URL")
    const both = await runCli(["sessions", "--url", h.url, "--socket", h.daemon.socketPath])
    assert.strictEqual(both.code, 2)

    const nothing = await runCli(["sessions", "--url", `http://127.0.0.1:${await freePort()}`], { env: wrong })
    assert.strictEqual(nothing.code, 3)
    assert.match(nothing.stderr, /cannot reach the daemon at http:\/\/127\.0\.0\.1:\d+ \(connection refused.*ECONNREFUSED\)/)

    // 421 and 403 as a daemon behind another name or a proxy would answer them (the daemon's
    // own gate answers them for headers a WebSocket client does not choose: httpSecurity).
    const statuses = [421, 403]
    const stub = http.createServer((_req, res) => res.end())
    stub.on("upgrade", (_req, socket) => {
      const status = statuses.shift() ?? 500
      const body = JSON.stringify({ error: { code: "x", message: `refused with ${status}`, requestId: "h-1" } })
      socket.end(`HTTP/1.1 ${status} No\r\ncontent-type: application/json\r\ncontent-length: ${body.length}\r\nconnection: close\r\n\r\n${body}`)
    })
    await new Promise<void>((resolve) => stub.listen(0, "127.0.0.1", resolve))
    try {
      const stubUrl = `http://127.0.0.1:${(stub.address() as { port: number }).port}`
      const misdirected = await runCli(["status", "--url", stubUrl], { env: wrong })
      assert.strictEqual(misdirected.code, 3)
      assert.include(misdirected.stderr, "refused the Host")
      assert.include(misdirected.stderr, "(421")
      const forbidden = await Client.connect({ url: stubUrl, token: "t" }).then(() => undefined, (e: unknown) => e as Msg)
      assert.strictEqual(forbidden?.["status"], 403)
      assert.include(String(forbidden?.["message"]), "refused the request (403) (refused with 403)")
    } finally {
      stub.close()
    }
  }, 60_000)
})
