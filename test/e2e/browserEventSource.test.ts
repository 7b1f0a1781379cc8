/**
 * A plain browser `EventSource` (in Debian's chromium, driven by playwright-core) follows a
 * session's events over `/v1/sessions/:id/events?live=sse` across a daemon SIGKILL and a restart
 * on the same port and state dir: the browser reconnects by itself with `Last-Event-ID`, and the
 * page ends with every event of the log exactly once, cursors contiguous.
 */
import { expect, it } from "vitest"
import { describeBrowser, useBrowser } from "../support/browser.js"
import { cleanUpAfterTests, cursorGap, type Msg, sleep } from "./harness.js"
import { cursorsOf, freePort, type HttpDaemon, isEventOf, readAll, request, useHttpDaemon, waitIdle } from "./httpHarness.js"

cleanUpAfterTests()

describeBrowser("a browser EventSource (e2e, chromium)", () => {
  const browser = useBrowser()

  it("follows a session across a daemon SIGKILL and restart, resuming by Last-Event-ID with no gap and no duplicate", async () => {
    const port = await freePort()
    let h = await useHttpDaemon({ port })
    const stateDir = h.daemon.stateDir
    const id = (await request(h, "POST", "/v1/sessions", { body: JSON.stringify({ config: { tokenDelayMs: 30 } }) })).json.activeSessionId as string
    await waitIdle(h, id)

    const page = await browser.newPage()
    try {
      // The login sets the HttpOnly cookie, which the EventSource then sends (same origin).
      const landed = await page.goto(`${h.url}/login?token=${h.token}`)
      expect(landed?.status()).toBe(200)
      // Runs in the page (this project's types have no DOM: the page's globals are `any` here).
      await page.evaluate((path) => {
        // eslint-disable-next-line @typescript-eslint/no-explicit-any
        const w = globalThis as any
        w.got = []
        w.ids = []
        w.opens = 0
        const source = new w.EventSource(path)
        source.onopen = () => w.opens++
        source.addEventListener("data", (ev: { readonly data: string; readonly lastEventId: string }) => {
          w.ids.push(ev.lastEventId)
          // One JSON array of messages per data event.
          w.got.push(...JSON.parse(ev.data))
        })
      }, `/v1/sessions/${id}/events?offset=-1&live=sse`)
      const got = () => page.evaluate(() => (globalThis as unknown as { got: Array<Msg> }).got)
      const waitGot = async (pred: (msgs: Array<Msg>) => boolean, what: string, timeoutMs = 20_000) => {
        const deadline = Date.now() + timeoutMs
        for (;;) {
          const msgs = await got()
          if (pred(msgs)) return msgs
          if (Date.now() > deadline) throw new Error(`the page's EventSource: ${what} not seen within ${timeoutMs} ms (${msgs.length} messages)`)
          await sleep(50)
        }
      }

      const words = Array.from({ length: 40 }, (_, i) => `w${i}`).join(" ")
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: words }) })
      await waitGot((m) => m.filter(isEventOf("message_update")).length >= 5, "deltas before the daemon kill")

      // The daemon dies mid-turn; a new one starts on the same state dir and port. The browser
      // reconnects by itself (the stream's `retry:`), sending the last `id:` it saw.
      await h.daemon.sigkill()
      h = await useHttpDaemon({ port, stateDir })
      await waitGot((m) => m.some((x) => isEventOf("turn_interrupted")(x) && x["event"].reason === "daemon_restarted"), "turn_interrupted(daemon_restarted)")
      await waitIdle(h, id)
      await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: "after restart" }) })
      await waitGot((m) => m.filter(isEventOf("agent_end")).length >= 1, "agent_end after the restart")
      await waitIdle(h, id)

      const truth = (await readAll(h, id)).messages
      const seen = await waitGot((m) => m.length >= truth.length, "the page catching up with the log")
      const { opens, ids } = await page.evaluate(() => {
        const w = globalThis as unknown as { opens: number; ids: Array<string> }
        return { opens: w.opens, ids: w.ids }
      })
      expect(opens).toBeGreaterThanOrEqual(2)
      expect(cursorGap(seen)).toBeUndefined()
      expect(cursorsOf(seen)).toEqual(cursorsOf(truth))
      expect(seen.map((m) => m["type"])).toEqual(truth.map((m) => m["type"]))
      // The last `id:` the browser holds is the offset of the log's last event.
      const last = truth.at(-1)!["meta"].cursor
      expect(ids.at(-1)).toBe(`${String(last.generation).padStart(16, "0")}_${String(last.sequence).padStart(16, "0")}`)
    } finally {
      await page.close()
    }
  }, 90_000)
})
