/**
 * How the command line shows a session to a person: transcript messages, a turn's events as
 * they stream (assistant text as it comes, tool calls and results on one line each, the end of
 * each turn), and session summaries. Pure string building, plus a small stateful renderer that
 * knows whether the output stands in the middle of a line.
 */
import type * as Protocol from "../Protocol.js"

/** JSON on one line, cut to `max` characters. */
export const compact = (value: unknown, max = 160): string => {
  let text: string
  try {
    text = typeof value === "string" ? value : JSON.stringify(value) ?? String(value)
  } catch {
    text = String(value)
  }
  text = text.replace(/\s*\n\s*/g, " ")
  return text.length > max ? `${text.slice(0, max - 3)}...` : text
}

const quoted = (content: string): string => content.replace(/\n+$/, "").split("\n").map((l) => `> ${l}`).join("\n")

/** One transcript message, ending with a newline. */
export const message = (m: Protocol.AgentMessage): string => {
  switch (m.role) {
    case "user":
      return `${quoted(m.content)}\n`
    case "tool": {
      // The call and its result, as a live view shows them.
      const name = m.toolName ?? m.toolCallId ?? "?"
      const call = m.toolArgs === undefined ? "" : `[tool ${name} ${compact(m.toolArgs)}]\n`
      return `${call}[tool ${name} ${m.isError === true ? "failed" : "->"} ${compact(m.content)}]\n`
    }
    default: {
      // An engine's error (the turn ended failed) is marked apart from what the model said.
      const content = m.role === "assistant" && m.isError === true ? `${FAILED_MARK} ${m.content}` : m.content
      const text = content.endsWith("\n") || content.length === 0 ? content : `${content}\n`
      // Cut while it streamed: what was said so far, then the mark a live view shows (the
      // transcript does not keep the reason).
      return m.interrupted === true ? `${text}${INTERRUPTED_MARK}\n` : text
    }
  }
}

export const TURN_ENDED = "-- turn ended --"
/** After a transcript message cut while it streamed (`interrupted`). */
export const INTERRUPTED_MARK = "-- turn interrupted --"
/** The mark of an assistant message that is an engine's error (`isError`): its turn failed. */
export const FAILED_MARK = "[turn failed]"
export const LIVE_SEPARATOR = "----- live -----"

/**
 * Renders a session's events as text. `write` receives what goes to stdout; the renderer keeps
 * track of the line so that a block (a user message, a tool line) always starts on a new one.
 */
export class EventRenderer {
  private atLineStart = true
  /** Streaming messages: their role, and whether any text of theirs was written. */
  private readonly streaming = new Map<string, { role: Protocol.AgentMessage["role"]; wrote: boolean }>()
  /** Tool calls whose result was shown (their `tool` message is then not shown again). */
  private readonly shownResults = new Set<string>()
  private readonly toolNames = new Map<string, string>()

  constructor(private readonly write: (s: string) => void) {}

  /** Whether the output ends in the middle of a line. */
  get midLine(): boolean {
    return !this.atLineStart
  }

  private out(s: string): void {
    if (s.length === 0) return
    this.write(s)
    this.atLineStart = s.endsWith("\n")
  }

  /** Ends the current line, if the output stands in the middle of one. */
  newline(): void {
    if (!this.atLineStart) this.out("\n")
  }

  /** A block that takes whole lines. */
  line(s: string): void {
    this.newline()
    this.out(s.endsWith("\n") ? s : `${s}\n`)
  }

  /** A transcript message (history). */
  message(m: Protocol.AgentMessage): void {
    if (m.role === "tool" && m.toolCallId !== undefined && this.shownResults.delete(m.toolCallId)) return
    this.line(message(m))
  }

  event(e: Protocol.AgentEvent): void {
    switch (e.type) {
      case "message_start": {
        this.streaming.set(e.message.id, { role: e.message.role, wrote: false })
        if (e.message.role === "assistant" && e.message.isError === true) {
          this.newline()
          this.out(`${FAILED_MARK} ${e.message.content}`)
          this.streaming.set(e.message.id, { role: "assistant", wrote: true })
        } else if (e.message.role === "assistant" && e.message.content.length > 0) {
          this.newline()
          this.out(e.message.content)
          this.streaming.set(e.message.id, { role: "assistant", wrote: true })
        }
        return
      }
      case "message_update": {
        const s = this.streaming.get(e.messageId)
        // A message whose start came before this view began is taken for the assistant's.
        if (s !== undefined && s.role !== "assistant") return
        if (s === undefined || !s.wrote) this.newline()
        this.streaming.set(e.messageId, { role: "assistant", wrote: true })
        this.out(e.delta)
        return
      }
      case "message_end": {
        const s = this.streaming.get(e.message.id)
        this.streaming.delete(e.message.id)
        if (s !== undefined && s.wrote) {
          this.newline()
          return
        }
        this.message(e.message)
        return
      }
      case "tool_execution_start":
        this.toolNames.set(e.toolCallId, e.name)
        this.line(`[tool ${e.name} ${compact(e.args)}]`)
        return
      case "tool_execution_end": {
        const name = this.toolNames.get(e.toolCallId) ?? e.toolCallId
        this.toolNames.delete(e.toolCallId)
        this.shownResults.add(e.toolCallId)
        this.line(`[tool ${name} ${e.isError ? "failed" : "->"} ${compact(e.result)}]`)
        return
      }
      case "agent_end":
        this.streaming.clear()
        this.line(e.error === undefined ? TURN_ENDED : `-- turn failed (${e.error.code}) --`)
        return
      case "turn_interrupted":
        this.streaming.clear()
        this.line(`-- turn interrupted (${e.reason}) --`)
        return
      default:
        return
    }
  }
}

/** `1 session`, `3 sessions`. */
export const count = (n: number, noun: string): string => `${n} ${noun}${n === 1 ? "" : "s"}`

/** `2026-12-01T02:37:42.123Z` -> `2026-12-01 02:37`. */
export const shortDate = (iso: string): string => iso.replace("T", " ").slice(0, 16)

/** The short form of a session id shown in tables: `s-` and 8 hex digits. */
export const shortId = (id: string): string => id.slice(0, 10)

/** Aligned columns (two spaces apart), the header in bold when `color`. */
export const alignedTable = (header: ReadonlyArray<string>, rows: ReadonlyArray<ReadonlyArray<string>>, color: boolean): string => {
  const widths = header.map((h, i) => Math.max(h.length, ...rows.map((r) => (r[i] ?? "").length)))
  const fmt = (r: ReadonlyArray<string>) => r.map((c, i) => (i === r.length - 1 ? c : c.padEnd(widths[i]!))).join("  ").trimEnd()
  const head = fmt(header)
  return [color ? `\x1b[1m${head}\x1b[22m` : head, ...rows.map(fmt)].join("\n")
}

/** A session's summary as `key value` lines. */
export const summaryLines = (s: Protocol.SessionSummary): string => {
  const rows: Array<[string, string]> = [
    ["id", s.activeSessionId],
    ["name", s.name ?? "-"],
    ["engine", s.engine],
    ["worker", `${s.worker}${s.workerPid === undefined ? "" : ` (pid ${s.workerPid})`}`],
    ["busy", s.busy ? "yes (a turn is running)" : "no"],
    ["messages", String(s.messageCount)],
    ["restarts", String(s.restarts)],
    ["created", s.createdAt],
    ["last cursor", s.lastEventCursor === undefined ? "-" : `${s.lastEventCursor.generation}:${s.lastEventCursor.sequence}`],
    ["telemetry", s.telemetry ? "on" : "off"],
    ...(s.damage === undefined ? [] : [["damage", s.damage.reason] as [string, string]])
  ]
  return rows.map(([k, v]) => `${k.padEnd(12)}${v}`).join("\n")
}
