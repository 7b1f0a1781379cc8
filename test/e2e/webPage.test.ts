/**
 * The web page at `/` in a real browser (Debian's chromium through playwright-core) against the
 * built daemon: one daemon and one browser for the file. Nothing is served before the token
 * login; the table shows the sessions and creates one; a prompt from the page streams its reply;
 * a reload mid-stream, a worker SIGKILL mid-turn and a daemon SIGKILL + restart mid-stream each
 * end with the page's transcript equal to `get_messages` (no duplicated, no missing text); a
 * `/compact` replaces the transcript.
 *
 * `AGENTD_UPDATE_SCREENSHOTS=1` writes the two views' screenshots to docs/ (the README shows
 * them); otherwise they go to the temp dir.
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { afterAll, beforeAll, expect, it } from "vitest"
import { describeBrowser, type Page, useBrowser } from "../support/browser.js"
import { type Daemon, freshStateDir, type Msg, PROJECT_ROOT, removeTempRoots, sleep, startDaemon } from "./harness.js"
import { freePort, type HttpDaemon, httpPortOf, request } from "./httpHarness.js"

const shotDir = process.env["AGENTD_UPDATE_SCREENSHOTS"] === "1" ? path.join(PROJECT_ROOT, "docs") : os.tmpdir()

const waitUntil = async <A>(what: string, probe: () => Promise<A | undefined | false>, timeoutMs = 20_000): Promise<A> => {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const v = await probe()
    if (v !== undefined && v !== false) return v
    if (Date.now() > deadline) throw new Error(`${what}: not within ${timeoutMs} ms`)
    await sleep(40)
  }
}

describeBrowser("the web page (e2e, chromium)", () => {
  const browser = useBrowser()
  const daemons: Array<Daemon> = []
  let h: HttpDaemon
  let port = 0
  let stateDir = ""

  const start = async () => {
    const daemon = await startDaemon({ stateDir, extraArgs: ["--http", `127.0.0.1:${port}`] })
    daemons.push(daemon)
    await httpPortOf(daemon)
    h = { daemon, port, url: `http://127.0.0.1:${port}`, token: fs.readFileSync(path.join(stateDir, "http-token"), "utf8").trim() }
  }
  beforeAll(async () => {
    port = await freePort()
    stateDir = freshStateDir()
    await start()
  }, 30_000)
  afterAll(async () => {
    for (const d of daemons) await d.cleanup()
    await removeTempRoots()
  })

  const create = async (body: Msg = {}) => {
    const res = await request(h, "POST", "/v1/sessions", { body: JSON.stringify(body) })
    expect(res.status, res.text).toBe(201)
    return res.json.activeSessionId as string
  }
  const summary = async (id: string) => (await request(h, "GET", `/v1/sessions/${id}`)).json as Msg
  const idle = (id: string) =>
    waitUntil(`session ${id} idle`, async () => {
      const s = await summary(id).catch(() => undefined)
      if (s?.["worker"] === "ready" && s["busy"] === false) {
        h.daemon.recordWorkers(s)
        return s
      }
      return undefined
    })
  const truth = async (id: string) => {
    const res = await request(h, "GET", `/v1/sessions/${id}/messages?limit=1000`)
    expect(res.status, res.text).toBe(200)
    return (res.json.messages as Array<Msg>).map((m) => ({ id: m["id"] as string, text: m["content"] as string }))
  }
  /** The transcript as the page shows it (each message's id and text). */
  const shown = (page: Page) =>
    page.$$eval("#messages [data-id]", (els) =>
      els.map((e) => ({
        id: e.getAttribute("data-id")!,
        text: (e.querySelector(".body") ?? e.querySelector(".tool-result"))?.textContent ?? ""
      })))
  const streamingText = (page: Page) => page.evaluate(() => (globalThis as unknown as { document: { querySelector(s: string): { textContent: string } | null } }).document.querySelector("#streaming .body")?.textContent ?? "")
  /** Waits until the page shows what `get_messages` holds, exactly. */
  const pageMatchesLog = async (page: Page, id: string) => {
    const expected = await truth(id)
    await waitUntil("the page's transcript equal to get_messages", async () => JSON.stringify(await shown(page)) === JSON.stringify(expected), 15_000)
      .catch(async (e) => {
        throw new Error(`${String(e)}\npage: ${JSON.stringify(await shown(page))}\nlog:  ${JSON.stringify(expected)}`)
      })
    return expected
  }
  const openSession = async (page: Page, id: string) => {
    await page.goto(`${h.url}/#/s/${id}`)
    await page.waitForSelector("#session-state .worker")
  }
  const words = (n: number, tag: string) => Array.from({ length: n }, (_, i) => `${tag}${i}`).join(" ")

  let page: Page
  let first = ""

  it("serves nothing without the token: the page, its script, the sessions and their events all answer 401", async () => {
    first = await create({ name: "first" })
    for (const target of ["/", "/app.js", "/app.css", "/v1/sessions", `/v1/sessions/${first}`, `/v1/sessions/${first}/snapshot`, `/v1/sessions/${first}/events?offset=-1`, `/v1/sessions/${first}/messages`]) {
      const res = await request(h, "GET", target, { noAuth: true })
      expect(res.status, target).toBe(401)
      expect(res.text).not.toContain(first)
    }
    page = await browser.newPage()
    const res = await page.goto(`${h.url}/`)
    expect(res?.status()).toBe(401)
    expect(await page.content()).not.toContain(first)
    // A wrong token sets no cookie: still nothing.
    expect((await page.goto(`${h.url}/login?token=${"x".repeat(43)}`))?.status()).toBe(401)
    expect((await page.goto(`${h.url}/v1/sessions`))?.status()).toBe(401)
  })

  it("after the login the table lists the sessions, filters by name, and creates one from the form", async () => {
    await idle(first)
    await create({ name: "second" })
    // The login link as `agentd web` prints it (no browser to open here: --print).
    const cli = spawnSync(process.execPath, [path.join(PROJECT_ROOT, "dist", "src", "bin", "agentd.cjs"), "web", "--print", "--http", `127.0.0.1:${port}`, "--state-dir", stateDir], { encoding: "utf8" })
    expect(cli.status, cli.stderr).toBe(0)
    expect(cli.stdout.trim()).toBe(`${h.url}/login?token=${h.token}`)
    expect((await page.goto(cli.stdout.trim()))?.status()).toBe(200)
    await page.setViewportSize({ width: 1100, height: 700 })
    await page.waitForSelector(`#sessions tr[data-id="${first}"]`)
    await waitUntil("two rows", async () => (await page.$$("#sessions tbody tr")).length === 2)
    expect(await page.textContent(`#sessions tr[data-id="${first}"]`)).toContain("first")
    await page.fill("#filter", "seco")
    await waitUntil("the filter", async () => (await page.$$("#sessions tbody tr:not([hidden])")).length === 1)
    expect(await page.isHidden(`#sessions tr[data-id="${first}"]`)).toBe(true)
    await page.fill("#filter", "")
    await page.screenshot({ path: path.join(shotDir, "web-sessions.png") })

    await page.fill("#new-name", "made-in-page")
    await page.fill("#new-config", '{"tokenDelayMs": 25}')
    await page.click("#create button[type=submit]")
    await page.waitForURL(/#\/s\/s-/)
    const made = decodeURIComponent(page.url().split("#/s/")[1]!)
    expect((await summary(made))["name"]).toBe("made-in-page")
    await page.waitForFunction(() => (globalThis as unknown as { document: { title: string } }).document.title.startsWith("made-in-page"))
  })

  it("a prompt from the page streams its reply (Enter sends, Shift+Enter is a new line, the box says why it is disabled while busy)", async () => {
    const id = decodeURIComponent(page.url().split("#/s/")[1]!)
    await idle(id)
    await page.waitForSelector("#prompt:not([disabled])")
    await page.focus("#prompt")
    await page.keyboard.type("line one")
    await page.keyboard.press("Shift+Enter")
    await page.keyboard.type(words(30, "a"))
    expect(await page.inputValue("#prompt")).toContain("line one\n")
    await page.keyboard.press("Enter")
    // Streamed: partial text shows before the message ends, and only ever grows.
    const samples = new Set<string>()
    await waitUntil("streamed text", async () => {
      const t = await streamingText(page)
      if (t !== "") samples.add(t)
      return samples.size >= 3
    })
    expect(await page.isDisabled("#prompt")).toBe(true)
    expect(await page.textContent("#prompt-reason")).toMatch(/turn is running/)
    await page.screenshot({ path: path.join(shotDir, "web-session.png") })
    await idle(id)
    const log = await pageMatchesLog(page, id)
    const reply = log.at(-1)!.text
    expect(log.at(-2)!.text).toBe(`line one\n${words(30, "a")}`)
    for (const s of samples) expect(reply.startsWith(s), s).toBe(true)
    await page.waitForSelector("#prompt:not([disabled])")

    // Readable on a phone: nothing wider than the screen.
    await page.setViewportSize({ width: 375, height: 700 })
    const overflow = await page.evaluate(() => (globalThis as unknown as { document: { documentElement: { scrollWidth: number } } }).document.documentElement.scrollWidth)
    expect(overflow).toBeLessThanOrEqual(375)
    await page.setViewportSize({ width: 1100, height: 700 })
  })

  it("on a phone (390x844) both views fit with no horizontal scroll, every control has an accessible name, and the prompt, Abort and Checkpoint work from the keyboard", async () => {
    // The session the page made (tokenDelayMs 25): no new session, the table test counts them.
    const id = decodeURIComponent(page.url().split("#/s/")[1]!)
    await idle(id)
    /** Controls without an accessible name, in the page's accessibility tree (hidden ones are not in it). */
    const unnamed = async () => {
      const tree = await page.ariaSnapshot()
      const controls = tree.split("\n").filter((l) => /^\s*- (button|textbox|combobox|checkbox|searchbox|spinbutton|radio|link)\b/.test(l))
      expect(controls.length, tree).toBeGreaterThan(2)
      return controls.filter((l) => /^\s*- \w+(?=$|:| \[)/.test(l))
    }
    const scrollWidth = () => page.evaluate(() => (globalThis as unknown as { document: { documentElement: { scrollWidth: number } } }).document.documentElement.scrollWidth)
    await page.setViewportSize({ width: 390, height: 844 })
    try {
      await page.goto(`${h.url}/#/`)
      await page.waitForSelector(`#sessions tr[data-id="${id}"]`)
      expect(await scrollWidth()).toBeLessThanOrEqual(390)
      expect(await unnamed()).toEqual([])
      await openSession(page, id)
      await page.waitForSelector("#prompt:not([disabled])")
      expect(await scrollWidth()).toBeLessThanOrEqual(390)
      expect(await unnamed()).toEqual([])
      // From the keyboard only: Tab to the prompt from the top, type, Enter sends.
      const tabTo = async (target: string) => {
        for (let i = 0; i < 40; i++) {
          if (await page.evaluate((t) => (globalThis as unknown as { document: { activeElement: { id: string } | null } }).document.activeElement?.id === t, target)) return
          await page.keyboard.press("Tab")
        }
        throw new Error(`#${target} not reached with Tab`)
      }
      await page.evaluate(() => (globalThis as unknown as { document: { activeElement: { blur(): void } | null } }).document.activeElement?.blur())
      await tabTo("prompt")
      await page.keyboard.type(words(200, "k"))
      await page.keyboard.press("Enter")
      await waitUntil("streamed text", async () => (await streamingText(page)).length > 10)
      // Abort, reached with Tab (enabled while the turn runs) and pressed with Enter.
      await tabTo("abort")
      await page.keyboard.press("Enter")
      await idle(id)
      await page.waitForSelector(".notice >> text=Aborted: this turn was interrupted.")
      expect(await scrollWidth()).toBeLessThanOrEqual(390)
      // Checkpoint, with Space: the notice comes only with the daemon's answer.
      await tabTo("checkpoint")
      await page.keyboard.press("Space")
      await page.waitForSelector(".notice >> text=Checkpoint taken.")
      expect(await page.textContent("#session-error")).toBe("")
    } finally {
      await page.setViewportSize({ width: 1100, height: 700 })
    }
  })

  it("a reload mid-stream resumes with no duplicated and no missing text", async () => {
    // A 5 s turn: the reload must land while it still streams (at load 9 in CI a reload and
    // its re-attach outlasted a 2 s turn, and the page, rightly, had nothing left to stream).
    const id = await create({ config: { tokenDelayMs: 100 } })
    await idle(id)
    await openSession(page, id)
    await page.fill("#prompt", words(50, "r"))
    await page.press("#prompt", "Enter")
    await waitUntil("some streamed text", async () => (await streamingText(page)).length > 20)
    await page.reload()
    const samples = new Set<string>()
    await waitUntil("streamed text after the reload", async () => {
      const t = await streamingText(page)
      if (t !== "") samples.add(t)
      return samples.size >= 2
    })
    await idle(id)
    const log = await pageMatchesLog(page, id)
    for (const s of samples) expect(log.at(-1)!.text.startsWith(s), s).toBe(true)
    expect(log.at(-1)!.text).toBe(`echo: ${words(50, "r")}`)
  })

  it("a worker killed mid-turn: the page shows the notice and the interrupted turn, then goes on", async () => {
    const id = await create({ config: { tokenDelayMs: 40 } })
    const s = await idle(id)
    await openSession(page, id)
    await page.fill("#prompt", words(50, "k"))
    await page.press("#prompt", "Enter")
    await waitUntil("some streamed text", async () => (await streamingText(page)).length > 20)
    process.kill(s["workerPid"] as number, "SIGKILL")
    await page.waitForSelector(".notice >> text=worker crashed")
    await idle(id)
    await pageMatchesLog(page, id)
    const cut = ((await request(h, "GET", `/v1/sessions/${id}/messages`)).json.messages as Array<Msg>).filter((m) => m["interrupted"] === true)
    expect(await page.$$eval(".msg.interrupted", (els) => els.map((e) => e.getAttribute("data-id")))).toEqual(cut.map((m) => m["id"]))
    await page.waitForSelector("#prompt:not([disabled])")
    await page.fill("#prompt", "after the crash")
    await page.press("#prompt", "Enter")
    await waitUntil("the reply after the crash", async () => (await shown(page)).some((m) => m.text === "echo: after the crash"))
  })

  it("/compact replaces the transcript", async () => {
    const id = await create()
    await idle(id)
    await openSession(page, id)
    for (const text of ["one", "two"]) {
      await page.fill("#prompt", text)
      await page.press("#prompt", "Enter")
      await waitUntil(`the reply to ${text}`, async () => (await shown(page)).some((m) => m.text === `echo: ${text}`))
      await idle(id)
      await page.waitForSelector("#prompt:not([disabled])")
    }
    await page.fill("#prompt", "/compact")
    await page.press("#prompt", "Enter")
    await page.waitForSelector(".notice >> text=history was rewritten")
    await idle(id)
    const log = await pageMatchesLog(page, id)
    expect(log.some((m) => m.text === "echo: one")).toBe(false)
    // A reload after the rewrite follows on from the replacement snapshot (its offset is also
    // one of the old history's: the stream names the snapshot, and the page has it).
    await page.reload()
    await page.waitForSelector("#session-state >> text=live")
    await page.fill("#prompt", "three")
    await page.press("#prompt", "Enter")
    await waitUntil("the reply to three", async () => (await shown(page)).some((m) => m.text === "echo: three"))
    await idle(id)
    await pageMatchesLog(page, id)
  })

  it("the daemon SIGKILLed and restarted mid-stream: the page continues with no duplicated and no missing text", async () => {
    const id = await create({ config: { tokenDelayMs: 40 } })
    await idle(id)
    await openSession(page, id)
    await page.fill("#prompt", words(60, "d"))
    await page.press("#prompt", "Enter")
    await waitUntil("some streamed text", async () => (await streamingText(page)).length > 20)
    await h.daemon.sigkill()
    await start()
    await page.waitForSelector(".notice >> text=daemon restarted")
    await idle(id)
    await pageMatchesLog(page, id)
    await page.waitForSelector("#prompt:not([disabled])")
    await page.fill("#prompt", "after the restart")
    await page.press("#prompt", "Enter")
    await waitUntil("the reply after the restart", async () => (await shown(page)).some((m) => m.text === "echo: after the restart"))
    await idle(id)
    const log = await pageMatchesLog(page, id)
    expect(log.at(-1)!.text).toBe("echo: after the restart")
    // No message twice.
    expect(new Set(log.map((m) => m.id)).size).toBe(log.length)
  })

  it("a long transcript: only its last 100 messages are read and in the DOM; earlier ones are read and page in as the reader scrolls up", async () => {
    const id = await create()
    await idle(id)
    // Just over one page of messages (each prompt adds two).
    const prompts = Number(process.env["AGENTD_WEB_PAGING_PROMPTS"] ?? "51")
    for (let i = 0; i < prompts; i++) {
      const res = await request(h, "POST", `/v1/sessions/${id}/prompt`, { body: JSON.stringify({ message: `m${i}` }) })
      expect(res.status, res.text).toBe(200)
      await idle(id)
    }
    // In the snapshot, not in events after it: what the page reads of the snapshot is its end.
    expect((await request(h, "POST", `/v1/sessions/${id}/checkpoint`)).status).toBe(200)
    const asked: Array<string> = []
    const onRequest = (r: { url(): string }) => void asked.push(new URL(r.url()).pathname + new URL(r.url()).search)
    page.on("request", onRequest)
    try {
      await openSession(page, id)
      await waitUntil("the last page", async () => (await shown(page)).at(-1)?.text === `echo: m${prompts - 1}`)
      expect((await shown(page)).length).toBe(Math.min(100, prompts * 2))
      expect(await page.textContent("#session-state")).toContain(`${prompts * 2} messages`)
      expect(asked.filter((u) => u.includes("/snapshot"))).toEqual([`/v1/sessions/${id}/snapshot?tailBytes=1048576`])
      await page.evaluate(() => {
        const t = (globalThis as unknown as { document: { querySelector(s: string): { scrollTop: number } } }).document.querySelector("#transcript")
        t.scrollTop = 0
      })
      await waitUntil("the earlier messages", async () => (await shown(page)).length === prompts * 2)
      expect(JSON.stringify(await shown(page))).toBe(JSON.stringify(await truth(id)))
      expect(await page.isHidden("#earlier")).toBe(true)
      // The messages before the snapshot's last 100 were read only now, and only they.
      const earlier = Math.max(0, prompts * 2 - 100)
      expect(asked.filter((u) => u.includes("/messages"))).toEqual(earlier === 0 ? [] : [`/v1/sessions/${id}/messages?offset=0&limit=${earlier}`])
    } finally {
      page.off("request", onRequest)
    }
  })

  it("1,000 sessions in the table: all listed, filtered at once, and a refresh redraws only the rows that changed", async () => {
    // The list is the daemon's own answer with a thousand synthetic sessions added (a thousand
    // real workers would cost minutes here); what is checked is the page's work, not the daemon's.
    const n = Number(process.env["AGENTD_WEB_TABLE_SESSIONS"] ?? "1000")
    let tick = 0
    await page.route("**/v1/sessions", async (route) => {
      if (route.request().method() !== "GET") return route.continue()
      const real = await route.fetch()
      const body = (await real.json()) as { sessions: Array<Msg> }
      tick++
      for (let i = 0; i < n; i++) {
        body.sessions.push({
          activeSessionId: `s-${String(i).padStart(8, "0")}-0000-0000-0000-000000000000`,
          name: `bulk-${i}`,
          engine: "echo",
          createdAt: new Date(Date.UTC(2026, 0, 1, 0, 0, i)).toISOString(),
          // One session's count moves with every refresh: only its row is to be redrawn.
          messageCount: i === 7 ? tick : 0,
          busy: false,
          worker: i % 100 === 0 ? "damaged" : "ready",
          restarts: 0,
          telemetry: false
        })
      }
      await route.fulfill({ response: real, json: body })
    })
    try {
      await page.goto(`${h.url}/#/`)
      await waitUntil("a thousand rows", async () => (await page.$$eval("#sessions tbody tr", (rows) => rows.length)) >= n)
      expect(await page.$$eval("#sessions .worker-damaged", (els) => els.length)).toBe(n / 100)
      // Rows rebuilt by the next refresh, counted by a MutationObserver on the table body.
      await page.evaluate(() => {
        // eslint-disable-next-line @typescript-eslint/no-explicit-any
        const g = globalThis as any
        g.rebuilt = new Set()
        new g.MutationObserver((records: Array<{ target: { closest(s: string): { getAttribute(a: string): string } | null } }>) => {
          for (const r of records) {
            const tr = r.target.closest("tr")
            if (tr !== null) g.rebuilt.add(tr.getAttribute("data-id"))
          }
        }).observe(g.document.querySelector("#sessions tbody"), { childList: true, subtree: true })
      })
      const before = tick
      await waitUntil("two more refreshes", async () => tick >= before + 2)
      await sleep(200)
      const rebuilt = await page.evaluate(() => [...(globalThis as unknown as { rebuilt: Set<string> }).rebuilt])
      expect(rebuilt).toContain("s-00000007-0000-0000-0000-000000000000")
      // Only the moving row (and real sessions whose activity text changed), never the thousand.
      expect(rebuilt.length).toBeLessThan(10)
      await page.fill("#filter", "bulk-99")
      await waitUntil("the filter", async () => (await page.$$("#sessions tbody tr:not([hidden])")).length === (n > 990 ? 11 : 1))
      expect(await page.textContent("#sessions-status")).toMatch(new RegExp(`shown`))
    } finally {
      await page.unroute("**/v1/sessions")
    }
  })

  it("the page's script stays within its size budget (100 KB gzipped)", async () => {
    const { gzipSync } = await import("node:zlib")
    const script = fs.readFileSync(path.join(PROJECT_ROOT, "dist", "src", "web", "app.js"))
    expect(gzipSync(script).length).toBeLessThan(100 * 1024)
  })
})
