/**
 * Session names are the daemon's (docs/protocol.md sections 3 and 9): `create` with a name in
 * use fails `name_taken`, checked atomically in the daemon (many racing creates: exactly one
 * wins); `rename` (socket, CLI, SDK, HTTP-free); names survive a daemon restart; sessions of an
 * older state dir that share a name still load, are addressable by id, and the one resolver
 * (CLI and SDK alike) calls the shared name ambiguous.
 *
 * Needs `npm run build` first.
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { assert, describe, it } from "vitest"
import * as SdkClient from "../../src/client.js"
import { runCli } from "./cliRun.js"
import { cleanUpAfterTests, createSession, e2eOnPostgres, useDaemon } from "./harness.js"

cleanUpAfterTests()

/** How many creates race for one name (AGENTD_E2E_NAME_RACE; small by default, the suite is on a budget). */
const RACE = Number(process.env["AGENTD_E2E_NAME_RACE"] ?? 24)

describe("session names (e2e)", () => {
  it("racing creates of one name: one wins, the others get name_taken; rename; names survive a restart; an older state dir's twins load and are ambiguous by name", async () => {
    const d = await useDaemon()
    const clients = await Promise.all(Array.from({ length: 4 }, (_, i) => d.connect(`racer-${i}`)))
    // Each connection sends its share at once, so the creates interleave inside the daemon.
    const answers = await Promise.all(
      Array.from({ length: RACE }, (_, i) => clients[i % clients.length]!.request({ type: "create", name: "race" }))
    )
    const won = answers.filter((r) => r["success"] === true)
    const lost = answers.filter((r) => r["success"] !== true)
    assert.strictEqual(won.length, 1, JSON.stringify(answers.map((r) => r["error"]?.code ?? "ok")))
    for (const r of lost) {
      assert.strictEqual(r["error"].code, "name_taken", JSON.stringify(r))
      assert.include(r["error"].message, "\"race\" is in use")
    }
    const winner = won[0]!["data"].activeSessionId as string
    const c = clients[0]!
    const listed = (await c.ok({ type: "list" }))["sessions"] as Array<{ name?: string; activeSessionId: string }>
    assert.deepStrictEqual(listed.filter((s) => s.name === "race").map((s) => s.activeSessionId), [winner])

    // rename: to a free name; onto a taken one refused; the old name is free again.
    const other = await createSession(c, { name: "other" })
    const refused = await c.request({ type: "rename", activeSessionId: other.id, name: "race" })
    assert.strictEqual(refused["error"]?.code, "name_taken", JSON.stringify(refused))
    const bad = await c.request({ type: "rename", activeSessionId: other.id, name: "" })
    assert.strictEqual(bad["error"]?.code, "invalid_command", JSON.stringify(bad))
    assert.include(bad["error"].message, "`name`")
    const renamed = await c.ok({ type: "rename", activeSessionId: winner, name: "renamed" })
    assert.strictEqual(renamed["name"], "renamed")
    const reused = await createSession(c, { name: "race" })
    const missing = await c.request({ type: "rename", activeSessionId: "s-nope", name: "x" })
    assert.strictEqual(missing["error"]?.code, "session_not_found")

    // CLI: rename by name; the SDK resolves the new name to the same session.
    const cli = await runCli(["rename", "other", "cli-named", "--socket", d.socketPath])
    assert.strictEqual(cli.code, 0, cli.stderr)
    assert.include(cli.stdout, `renamed ${other.id} to cli-named`)
    const taken = await runCli(["rename", "cli-named", "renamed", "--socket", d.socketPath])
    assert.strictEqual(taken.code, 1)
    assert.include(taken.stderr, `"renamed" is in use by session ${winner}`)
    const sdk = await SdkClient.connect({ socketPath: d.socketPath })
    try {
      assert.strictEqual((await sdk.session("cli-named").getState()).activeSessionId, other.id)
      assert.strictEqual(await sdk.resolve(winner.slice(2, 12)), winner)
      const handle = sdk.session("renamed")
      assert.strictEqual((await handle.rename("via-sdk")).name, "via-sdk")
      assert.strictEqual(handle.activeSessionId, winner)
      const none = await sdk.session("no-such-name").getState().then(() => undefined, (e: unknown) => e)
      assert.instanceOf(none, SdkClient.DaemonError)
      assert.strictEqual((none as SdkClient.DaemonError).code, "session_not_found")
    } finally {
      await sdk.close()
    }
    // A killed session's name is free.
    await c.ok({ type: "kill", activeSessionId: reused.id })
    const third = await createSession(c, { name: "race" })

    // Restart (after SIGKILL): the names are in each session's meta. And an older daemon let names repeat:
    // a session of such a state dir (made here by editing its meta) shares "twin" with another.
    const a = await createSession(c, { name: "twin" })
    const b = await createSession(c, { name: "twin-b" })
    await d.sigkill() // names are durable as soon as they are answered, not only at a graceful stop
    if (!e2eOnPostgres) {
      const sessionsDir = path.join(d.stateDir, "sessions")
      const metaFile = fs.readdirSync(sessionsDir).map((dir) => path.join(sessionsDir, dir, "meta.json"))
        .find((f) => fs.existsSync(f) && JSON.parse(fs.readFileSync(f, "utf8")).activeSessionId === b.id)
      assert.isDefined(metaFile)
      const meta = JSON.parse(fs.readFileSync(metaFile!, "utf8"))
      fs.writeFileSync(metaFile!, JSON.stringify({ ...meta, name: "twin" }, null, 2) + "\n")
    }
    const d2 = await useDaemon({ stateDir: d.stateDir })
    const c2 = await d2.connect()
    const after = (await c2.ok({ type: "list" }))["sessions"] as Array<{ name?: string; activeSessionId: string; worker: string }>
    const names = Object.fromEntries(after.map((s) => [s.activeSessionId, s.name]))
    assert.deepStrictEqual([names[winner], names[other.id], names[third.id]], ["via-sdk", "cli-named", "race"])
    const again = await c2.request({ type: "create", name: "via-sdk" })
    assert.strictEqual(again["error"]?.code, "name_taken")
    if (e2eOnPostgres) return

    // The twins load (none damaged) and are addressable by id.
    assert.deepStrictEqual(after.filter((s) => s.name === "twin").map((s) => s.activeSessionId).sort(), [a.id, b.id].sort())
    assert.isTrue(after.every((s) => s.worker !== "damaged"), JSON.stringify(after))
    const byId = await runCli(["prompt", b.id, "hello twin", "--socket", d2.socketPath])
    assert.deepStrictEqual([byId.code, byId.stdout], [0, "echo: hello twin\n"], byId.stderr)
    // By the shared name: ambiguous, with both candidates, to the CLI and the SDK alike.
    const byName = await runCli(["state", "twin", "--socket", d2.socketPath])
    assert.strictEqual(byName.code, 1)
    assert.include(byName.stderr, `"twin" matches 2 sessions`)
    assert.include(byName.stderr, a.id)
    assert.include(byName.stderr, b.id)
    const sdk2 = await SdkClient.connect({ socketPath: d2.socketPath })
    try {
      const e = await sdk2.resolve("twin").then(() => undefined, (err: unknown) => err)
      assert.instanceOf(e, SdkClient.AmbiguousSession)
      assert.deepStrictEqual([...(e as SdkClient.AmbiguousSession).candidates].sort(), [a.id, b.id].sort())
      // A new session cannot take the shared name; renaming one of the twins settles it.
      const create = await c2.request({ type: "create", name: "twin" })
      assert.strictEqual(create["error"]?.code, "name_taken")
      await sdk2.session(b.id).rename("twin-again")
      assert.strictEqual(await sdk2.resolve("twin"), a.id)
    } finally {
      await sdk2.close()
    }
    const byNameNow = await runCli(["state", "twin", "--json", "--socket", d2.socketPath])
    assert.strictEqual(JSON.parse(byNameNow.stdout).activeSessionId, a.id, byNameNow.stderr)
  })
})
