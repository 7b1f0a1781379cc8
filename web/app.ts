/**
 * The daemon's web page (served at `/` by the HTTP front after the token login): a live table of
 * the sessions, and one session's transcript with a prompt box. Plain TypeScript and the DOM, no
 * framework: two views, a table and a list, do not need one, and the bundle stays small. Text
 * from sessions only ever goes into `textContent`, never into markup.
 */
import type * as Protocol from "../src/Protocol.js"
import { api, ApiError, describeError } from "./api.js"
import { Follower, type Notice } from "./follow.js"

// ---------------------------------------------------------------------------------------------
// Small DOM helpers
// ---------------------------------------------------------------------------------------------

type Attrs = Record<string, string | boolean | undefined>

const h = <K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: Attrs = {},
  ...children: Array<Node | string | undefined>
): HTMLElementTagNameMap[K] => {
  const el = document.createElement(tag)
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === false) continue
    el.setAttribute(k, v === true ? "" : v)
  }
  for (const c of children) if (c !== undefined) el.append(c)
  return el
}

const main = () => document.getElementById("main")!

const shortId = (id: string) => id.replace(/^s-/, "").slice(0, 8)

const timeText = (ms: number | undefined): string => {
  if (ms === undefined) return "–"
  const s = Math.round((Date.now() - ms) / 1000)
  if (s < 5) return "just now"
  if (s < 60) return `${s} s ago`
  if (s < 3600) return `${Math.floor(s / 60)} min ago`
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`
  return new Date(ms).toLocaleString()
}

/** The current view's teardown (timers, the follower). */
let teardown: () => void = () => {}

// ---------------------------------------------------------------------------------------------
// Sessions
// ---------------------------------------------------------------------------------------------

interface Row {
  readonly tr: HTMLTableRowElement
  key: string
  name: string
  /** When this page saw the session's last event cursor move (or its creation). */
  activity: number
  cursor: string
}

const ENGINES = ["echo", "openai", "openai-compat", "anthropic"]

const sessionsView = (): void => {
  const rows = new Map<string, Row>()
  const status = h("p", { id: "sessions-status", role: "status", class: "muted" }, "Loading…")
  const errorLine = h("p", { id: "sessions-error", role: "alert", class: "error" })
  const filter = h("input", { id: "filter", type: "search", placeholder: "name", autocomplete: "off" })
  const tbody = h("tbody")
  const table = h(
    "table",
    { id: "sessions", class: "sessions" },
    h("caption", { class: "sr-only" }, "Sessions"),
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        ...["Name", "Id", "Engine", "Worker", "Busy", "Messages", "Last activity", "Restarts", "Actions"].map((t) => h("th", { scope: "col" }, t))
      )
    ),
    tbody
  )

  // The create form.
  const nameInput = h("input", { id: "new-name", name: "name", autocomplete: "off" })
  const engineInput = h("input", { id: "new-engine", name: "engine", list: "engines", value: "echo" })
  const configInput = h("textarea", { id: "new-config", name: "config", rows: "2", placeholder: '{"tokenDelayMs": 20}' })
  const createButton = h("button", { type: "submit" }, "Create")
  const form = h(
    "form",
    { id: "create", class: "create", "aria-label": "Create a session" },
    h("div", { class: "field" }, h("label", { for: "new-name" }, "Name"), nameInput),
    h("div", { class: "field" }, h("label", { for: "new-engine" }, "Engine"), engineInput),
    h("datalist", { id: "engines" }, ...ENGINES.map((e) => h("option", { value: e }))),
    h("div", { class: "field grow" }, h("label", { for: "new-config" }, "Config (JSON, optional)"), configInput),
    createButton
  )
  form.addEventListener("submit", (ev) => {
    ev.preventDefault()
    void (async () => {
      errorLine.textContent = ""
      let config: unknown
      if (configInput.value.trim() !== "") {
        try {
          config = JSON.parse(configInput.value)
        } catch (e) {
          errorLine.textContent = `The config is not JSON: ${describeError(e)}`
          configInput.focus()
          return
        }
      }
      createButton.disabled = true
      try {
        const body: Record<string, unknown> = { engine: engineInput.value.trim() || "echo" }
        if (nameInput.value.trim() !== "") body["name"] = nameInput.value.trim()
        if (config !== undefined) body["config"] = config
        const created = await api<{ activeSessionId: string }>("POST", "/v1/sessions", body)
        location.hash = `#/s/${encodeURIComponent(created.activeSessionId)}`
      } catch (e) {
        errorLine.textContent = `Create failed: ${describeError(e)}`
      } finally {
        createButton.disabled = false
      }
    })()
  })

  const applyFilter = () => {
    const f = filter.value.trim().toLowerCase()
    let shown = 0
    for (const row of rows.values()) {
      const hide = f !== "" && !row.name.toLowerCase().includes(f)
      if (row.tr.hidden !== hide) row.tr.hidden = hide
      if (!hide) shown++
    }
    status.textContent = `${rows.size} session${rows.size === 1 ? "" : "s"}${f === "" ? "" : `, ${shown} shown`}`
  }
  filter.addEventListener("input", applyFilter)

  const act = async (what: string, method: string, path: string) => {
    errorLine.textContent = ""
    try {
      await api(method, path)
      void refresh()
    } catch (e) {
      errorLine.textContent = `${what} failed: ${describeError(e)}`
    }
  }

  const renderRow = (row: Row, s: Protocol.SessionSummary) => {
    const tr = row.tr
    tr.replaceChildren()
    const label = s.name ?? shortId(s.activeSessionId)
    const cells: Array<Node | string> = [
      h("a", { href: `#/s/${encodeURIComponent(s.activeSessionId)}` }, label),
      h("code", { title: s.activeSessionId }, shortId(s.activeSessionId)),
      s.engine,
      h("span", { class: `worker worker-${s.worker}`, title: s.damage?.reason }, s.worker),
      s.busy ? "busy" : "idle",
      String(s.messageCount),
      timeText(row.activity),
      String(s.restarts)
    ]
    for (const c of cells) tr.append(h("td", {}, c))
    const actions = h("td", { class: "actions" })
    if (s.worker === "failed" || s.worker === "damaged") {
      const retry = h("button", { type: "button", "aria-label": `Retry the worker of ${label}` }, "Retry")
      retry.addEventListener("click", () => void act("Retry", "POST", `/v1/sessions/${encodeURIComponent(s.activeSessionId)}/retry`))
      actions.append(retry)
    }
    const kill = h("button", { type: "button", class: "danger", "aria-label": `Kill ${label}` }, "Kill")
    kill.addEventListener("click", () => {
      if (confirm(`Kill session ${label}? Its files move to the archive.`)) {
        void act("Kill", "DELETE", `/v1/sessions/${encodeURIComponent(s.activeSessionId)}`)
      }
    })
    actions.append(kill)
    tr.append(actions)
  }

  let timer: ReturnType<typeof setTimeout> | undefined
  let alive = true
  const refresh = async () => {
    clearTimeout(timer)
    try {
      const list = await api<{ sessions: ReadonlyArray<Protocol.SessionSummary> }>("GET", "/v1/sessions")
      if (!alive) return
      const seen = new Set<string>()
      const now = Date.now()
      const sorted = [...list.sessions].sort((a, b) => b.createdAt.localeCompare(a.createdAt))
      let before: Node | null = tbody.firstChild
      for (const s of sorted) {
        seen.add(s.activeSessionId)
        const cursor = s.lastEventCursor === undefined ? "" : `${s.lastEventCursor.generation}:${s.lastEventCursor.sequence}`
        let row = rows.get(s.activeSessionId)
        if (row === undefined) {
          row = { tr: h("tr", { "data-id": s.activeSessionId }), key: "", name: s.name ?? "", activity: Date.parse(s.createdAt), cursor }
          rows.set(s.activeSessionId, row)
        } else if (row.cursor !== cursor) {
          row.cursor = cursor
          row.activity = now
        }
        // Only rows whose summary changed are rebuilt: a thousand rows refresh cheaply.
        const key = `${JSON.stringify(s)}|${timeText(row.activity)}`
        if (key !== row.key) {
          row.key = key
          row.name = s.name ?? ""
          renderRow(row, s)
        }
        if (row.tr !== before) tbody.insertBefore(row.tr, before)
        else before = before.nextSibling
        before = row.tr.nextSibling
      }
      for (const [id, row] of rows) {
        if (!seen.has(id)) {
          row.tr.remove()
          rows.delete(id)
        }
      }
      applyFilter()
      table.setAttribute("aria-busy", "false")
    } catch (e) {
      if (!alive) return
      errorLine.textContent = e instanceof ApiError && e.status === 401
        ? "Not logged in: open the login link (`agentd web` prints it)."
        : `Cannot read the sessions: ${describeError(e)}`
    }
    if (alive) timer = setTimeout(() => void refresh(), 1500)
  }

  main().replaceChildren(
    h("h1", {}, "Sessions"),
    form,
    errorLine,
    h("div", { class: "toolbar" }, h("label", { for: "filter" }, "Filter by name"), filter, status),
    h("div", { class: "table-wrap" }, table)
  )
  document.title = "Sessions · agentd"
  void refresh()
  teardown = () => {
    alive = false
    clearTimeout(timer)
  }
}

// ---------------------------------------------------------------------------------------------
// One session
// ---------------------------------------------------------------------------------------------

/** Messages put in the DOM at a time; more page in as the reader scrolls up. */
const PAGE = 100

const messageView = (m: Protocol.AgentMessage, streaming = false): HTMLElement => {
  if (m.role === "tool") {
    const args = m.toolArgs === undefined ? undefined : h("pre", { class: "tool-args" }, JSON.stringify(m.toolArgs, null, 2))
    return h(
      "details",
      { class: `msg tool${m.isError === true ? " failed" : ""}`, "data-id": m.id },
      h("summary", {}, "Tool ", h("code", {}, m.toolName ?? m.toolCallId ?? "call"), m.isError === true ? h("span", { class: "badge error" }, "failed") : undefined),
      args,
      h("pre", { class: "tool-result" }, m.content)
    )
  }
  const badges: Array<HTMLElement> = []
  if (m.interrupted === true) badges.push(h("span", { class: "badge warn" }, "interrupted"))
  if (m.isError === true) badges.push(h("span", { class: "badge error" }, "failed"))
  if (streaming) badges.push(h("span", { class: "badge live" }, "streaming"))
  const cls = `msg ${m.role}${m.interrupted === true ? " interrupted" : ""}${m.isError === true ? " failed" : ""}${streaming ? " streaming" : ""}`
  return h(
    "article",
    { class: cls, "data-id": m.id },
    h("div", { class: "who" }, m.role === "user" ? "You" : "Assistant", ...badges),
    ...longText(m.content)
  )
}

/** Characters of a message shown before "Show all": laying out megabytes of text takes seconds. */
const SHOWN_CHARS = 20_000

/** A message's body, cut at SHOWN_CHARS with a button that shows the rest. */
const longText = (content: string): Array<HTMLElement> => {
  const body = h("div", { class: "body" }, content.length > SHOWN_CHARS ? content.slice(0, SHOWN_CHARS) : content)
  if (content.length <= SHOWN_CHARS) return [body]
  const all = h("button", { type: "button", class: "show-all" }, `Show all (${Math.round(content.length / 1024)} KB)`)
  all.addEventListener("click", () => {
    body.textContent = content
    all.remove()
  })
  return [body, all]
}

const noticeView = (n: Notice): HTMLElement => h("p", { class: `notice ${n.kind}`, role: n.kind === "error" ? "alert" : undefined }, n.text)

const sessionView = (id: string): void => {
  let follower: Follower
  const title = h("h1", {}, shortId(id))
  const state = h("p", { id: "session-state", class: "muted", role: "status" })
  const errorLine = h("p", { id: "session-error", role: "alert", class: "error" })
  const more = h("button", { type: "button", id: "earlier", class: "earlier", hidden: true }, "Show earlier messages")
  const list = h("div", { id: "messages" })
  const live = h("div", { id: "streaming" })
  const transcript = h("section", { id: "transcript", class: "transcript", "aria-label": "Transcript", tabindex: "0" }, more, list, live)
  const prompt = h("textarea", { id: "prompt", rows: "3", placeholder: "Message (Enter sends, Shift+Enter for a new line)", "aria-describedby": "prompt-reason" })
  const send = h("button", { type: "submit", id: "send" }, "Send")
  const reason = h("p", { id: "prompt-reason", class: "muted", "aria-live": "polite" })
  const form = h("form", { id: "prompt-form", class: "prompt" }, h("label", { for: "prompt" }, "Message"), h("div", { class: "prompt-row" }, prompt, send), reason)
  const button = (label: string, idAttr: string, cls = "") => h("button", { type: "button", id: idAttr, class: cls }, label)
  const abort = button("Abort", "abort")
  const checkpoint = button("Checkpoint", "checkpoint")
  const retry = button("Retry", "retry")
  const kill = button("Kill", "kill", "danger")

  const path = (suffix = "") => `/v1/sessions/${encodeURIComponent(id)}${suffix}`
  const act = async (what: string, method: string, p: string, body?: unknown) => {
    errorLine.textContent = ""
    try {
      return await api(method, p, body)
    } catch (e) {
      errorLine.textContent = `${what} failed: ${describeError(e)}`
      return undefined
    }
  }
  abort.addEventListener("click", () => void act("Abort", "POST", path("/abort"), {}))
  checkpoint.addEventListener("click", () =>
    void act("Checkpoint", "POST", path("/checkpoint"), {}).then((r) => {
      if (r !== undefined) follower.notice("info", "Checkpoint taken.")
      render()
    }))
  retry.addEventListener("click", () => void act("Retry", "POST", path("/retry"), {}))
  kill.addEventListener("click", () => {
    if (confirm("Kill this session? Its files move to the archive.")) {
      void act("Kill", "DELETE", path()).then((r) => {
        if (r !== undefined) location.hash = "#/"
      })
    }
  })

  const submit = async () => {
    const message = prompt.value
    if (message.trim() === "" || prompt.disabled) return
    send.disabled = true
    const r = await act("Send", "POST", path("/prompt"), { message })
    if (r !== undefined) prompt.value = ""
    render()
    prompt.focus()
  }
  form.addEventListener("submit", (ev) => {
    ev.preventDefault()
    void submit()
  })
  prompt.addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault()
      void submit()
    }
  })

  // What is in the DOM: messages [start, end) of the fold's transcript, the notices up to `notices`.
  let epoch = -1
  let start = 0
  let end = 0
  let notices = 0

  const nearBottom = () => transcript.scrollHeight - transcript.scrollTop - transcript.clientHeight < 80

  const appendUpTo = (target: HTMLElement, from: number, to: number, noticeFrom: number, noticeTo: number) => {
    const msgs = follower.fold.messages
    const frag = document.createDocumentFragment()
    let n = noticeFrom
    for (let i = from; i < to; i++) {
      while (n < noticeTo && follower.notices[n]!.at <= i) frag.append(noticeView(follower.notices[n++]!))
      frag.append(messageView(msgs[i]!))
    }
    while (n < noticeTo && follower.notices[n]!.at <= to) frag.append(noticeView(follower.notices[n++]!))
    target.append(frag)
    return n
  }

  const render = () => {
    const fold = follower.fold
    const stick = nearBottom()
    const msgs = fold.messages
    if (follower.epoch !== epoch || msgs.length < end) {
      // A new baseline: the transcript is drawn again from its last page.
      epoch = follower.epoch
      start = Math.max(0, msgs.length - PAGE)
      list.replaceChildren()
      notices = follower.notices.findIndex((n) => n.at >= start)
      if (notices < 0) notices = follower.notices.length
      notices = appendUpTo(list, start, msgs.length, notices, follower.notices.length)
      end = msgs.length
    } else if (msgs.length > end || notices < follower.notices.length) {
      notices = appendUpTo(list, end, msgs.length, notices, follower.notices.length)
      end = msgs.length
      // A reader at the bottom keeps one page in the DOM, however many events come (a catch-up
      // from the last checkpoint can be the whole session); one who scrolled up keeps all.
      while (stick && end - start > PAGE && list.firstElementChild !== null) {
        const first = list.firstElementChild
        if (first.hasAttribute("data-id")) start++
        first.remove()
      }
    }
    more.hidden = start === 0 && follower.earlier === 0
    live.replaceChildren(...(fold.streaming === undefined ? [] : [messageView(fold.streaming, true)]))
    if (stick) transcript.scrollTop = transcript.scrollHeight

    const s = fold.summary
    const name = s?.name ?? shortId(id)
    title.textContent = name
    document.title = `${name} · agentd`
    const worker = s?.worker ?? "unknown"
    const count = follower.earlier + msgs.length
    state.replaceChildren(
      h("span", { class: `worker worker-${worker}` }, worker),
      ` · ${fold.busy ? "busy" : "idle"} · ${count} message${count === 1 ? "" : "s"} · ${s?.engine ?? ""} · `,
      h("code", { title: id }, shortId(id)),
      ` · ${follower.connection}`
    )
    const why = fold.closed !== undefined
      ? "The session is closed."
      : worker === "failed" || worker === "damaged"
      ? `The worker is ${worker}: Retry restarts it.`
      : fold.busy
      ? "A turn is running: wait for it to end, or Abort it."
      : worker === "recovering" || worker === "starting"
      ? `The worker is ${worker}…`
      : follower.connection === "stopped"
      ? "Not following the session."
      : ""
    prompt.disabled = why !== ""
    send.disabled = why !== ""
    reason.textContent = why
    abort.disabled = !fold.busy
    retry.hidden = !(worker === "failed" || worker === "damaged")
  }

  // Earlier messages page in above, keeping what the reader looks at in place: from the fold,
  // or, before its first one, read from the daemon first.
  let loading = false
  const showEarlier = () => {
    if (start === 0) {
      if (follower.earlier === 0 || loading) return
      loading = true
      more.textContent = "Loading earlier messages…"
      void follower.loadEarlier(PAGE).then((n) => {
        // Put in front of the fold: what the DOM holds moved on by as many.
        start += n
        end += n
        if (n > 0) showEarlier()
      }, (e) => {
        errorLine.textContent = `Loading earlier messages failed: ${describeError(e)}`
      }).finally(() => {
        loading = false
        more.textContent = "Show earlier messages"
        more.hidden = start === 0 && follower.earlier === 0
      })
      return
    }
    const from = Math.max(0, start - PAGE)
    const height = transcript.scrollHeight
    const frag = document.createElement("div")
    const noticeFrom = follower.notices.findIndex((n) => n.at > from)
    const noticeTo = follower.notices.findIndex((n) => n.at >= start)
    appendUpTo(frag, from, start, noticeFrom < 0 ? 0 : noticeFrom, noticeTo < 0 ? follower.notices.length : noticeTo)
    list.prepend(...frag.childNodes)
    start = from
    more.hidden = start === 0 && follower.earlier === 0
    transcript.scrollTop += transcript.scrollHeight - height
  }
  more.addEventListener("click", showEarlier)
  const observer = new IntersectionObserver((entries) => {
    if (entries.some((e) => e.isIntersecting)) showEarlier()
  }, { root: transcript })
  observer.observe(more)

  follower = new Follower(id, render)
  main().replaceChildren(
    h("nav", { class: "crumbs" }, h("a", { href: "#/" }, "← Sessions")),
    h("div", { class: "session-head" }, title, h("div", { class: "buttons" }, abort, checkpoint, retry, kill)),
    state,
    errorLine,
    transcript,
    form
  )
  render()
  void follower.start()
  prompt.focus()
  teardown = () => {
    observer.disconnect()
    follower.stop()
  }
}

// ---------------------------------------------------------------------------------------------
// Routing: #/ (sessions), #/s/<id> (one session)
// ---------------------------------------------------------------------------------------------

const route = () => {
  teardown()
  teardown = () => {}
  const m = /^#\/s\/(.+)$/.exec(location.hash)
  if (m !== null) sessionView(decodeURIComponent(m[1]!))
  else sessionsView()
}

window.addEventListener("hashchange", route)
route()
