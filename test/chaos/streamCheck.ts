/**
 * What one client sees of one session, checked message by message against the protocol's
 * delivery promises (every sequenced event in cursor order, each once, no gap that a `resync`
 * or `replacement` snapshot does not explain, frames and `session_attached` in their place),
 * and the session's transcript as the client folds it.
 *
 * A gap between two generations cannot be seen from one client alone (a generation may end at
 * any sequence), so every event seen by any client goes into the session's {@link Truth}, and
 * every generation jump a client made is checked against it: no event seen by anyone may lie
 * strictly between the two cursors of a jump.
 *
 * Plain TypeScript, no I/O: the unit test feeds it hand-made message sequences.
 */

// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Msg = Record<string, any>

export interface Cursor {
  readonly generation: number
  readonly sequence: number
}

export const compareCursor = (a: Cursor, b: Cursor): number =>
  a.generation !== b.generation ? a.generation - b.generation : a.sequence - b.sequence

export const fmtCursor = (c: Cursor | undefined): string => (c === undefined ? "-" : `${c.generation}:${c.sequence}`)

const SEQUENCED = new Set(["session_event", "session_status", "session_closed"])
export const isSequenced = (m: Msg): boolean => SEQUENCED.has(m["type"])
const SNAPSHOT_FRAMES = new Set(["session_snapshot_begin", "session_snapshot_chunk", "session_snapshot_end", "session_snapshot_failed"])
export const isSnapshotFrame = (m: Msg): boolean => SNAPSHOT_FRAMES.has(m["type"])

/** A short description of a message, for failure output. */
export const describeMsg = (m: Msg): string => {
  const c = m["meta"]?.cursor as Cursor | undefined
  const cur = c !== undefined ? `@${fmtCursor(c)}${m["meta"]?.replayed === true ? "r" : ""}` : ""
  switch (m["type"]) {
    case "session_event": {
      const e = m["event"] ?? {}
      return `ev:${e.type}${e.type === "turn_interrupted" ? `(${e.reason})` : ""}${cur}`
    }
    case "session_status":
      return `status(busy=${m["state"]?.busy},worker=${m["state"]?.worker})${cur}`
    case "session_closed":
      return `closed(${m["reason"]})${cur}`
    case "response":
      return `resp(${m["command"]},${m["success"] === true ? "ok" : m["error"]?.code})`
    case "session_snapshot_begin":
      return `snap_begin(${m["purpose"]},${m["snapshotId"]},cursor=${fmtCursor(m["cursor"])})`
    case "session_snapshot_chunk":
      return `snap_chunk(${m["index"]})`
    case "session_attached":
      return `attached(${m["replay"]?.status}${m["replay"]?.reason === undefined ? "" : `/${m["replay"].reason}`},${m["replay"]?.eventCount ?? "-"} events,${m["snapshot"]?.messages?.length ?? "-"} msgs)`
    default:
      return String(m["type"])
  }
}

/** A broken promise: which invariant, and what was seen. */
export class Violation extends Error {
  constructor(readonly invariant: string, readonly details: string) {
    super(`${invariant}: ${details}`)
  }
}

/** A transcript message as a client folds it (what `get_messages` must return too). */
export interface FoldedMessage {
  readonly id: string
  readonly role: string
  readonly content: string
}

const foldedOf = (m: Msg): FoldedMessage => ({ id: String(m["id"]), role: String(m["role"]), content: String(m["content"]) })

/** A generation jump a client made (or the start of a baseline), to check against the truth. */
export interface Jump {
  /** The last cursor before the jump (undefined: the very start of the session). */
  readonly from: Cursor | undefined
  readonly to: Cursor
  readonly where: string
}

/** Every event of a session that any client saw, by cursor; and the jumps to check. */
export class Truth {
  private readonly byCursor = new Map<string, string>()
  private sorted: Array<Cursor> | undefined
  readonly jumps: Array<Jump> = []
  private checkedJumps = 0

  constructor(readonly activeSessionId: string) {}

  get size(): number {
    return this.byCursor.size
  }

  /** Records an event; a cursor that names two different events is a violation. */
  see(m: Msg, where: string): void {
    const c = m["meta"].cursor as Cursor
    const key = fmtCursor(c)
    const signature = `${m["type"]}/${m["event"]?.type ?? m["state"]?.worker ?? m["reason"] ?? ""}/${m["meta"].emittedAt}`
    const known = this.byCursor.get(key)
    if (known === undefined) {
      this.byCursor.set(key, signature)
      this.sorted = undefined
    } else if (known !== signature) {
      throw new Violation("one event per cursor", `${where}: cursor ${key} of ${this.activeSessionId} names ${signature}, seen before as ${known}`)
    }
  }

  /** The seen cursors strictly between `from` and `to` (from undefined: everything before `to`). */
  between(from: Cursor | undefined, to: Cursor): Array<Cursor> {
    if (this.sorted === undefined) {
      this.sorted = [...this.byCursor.keys()].map((k) => {
        const [g, s] = k.split(":")
        return { generation: Number(g), sequence: Number(s) }
      }).sort(compareCursor)
    }
    return this.sorted.filter((c) => (from === undefined || compareCursor(c, from) > 0) && compareCursor(c, to) < 0)
  }

  /** Checks the jumps recorded since the last call (`all`: every jump again, the truth having grown). */
  checkJumps(all = false): void {
    const start = all ? 0 : this.checkedJumps
    for (let i = start; i < this.jumps.length; i++) {
      const j = this.jumps[i]!
      const skipped = this.between(j.from, j.to)
      if (skipped.length > 0) {
        throw new Violation(
          "no gap",
          `${j.where}: jumped from ${fmtCursor(j.from)} to ${fmtCursor(j.to)} of ${this.activeSessionId} without a resync, ` +
            `skipping ${skipped.length} event(s) that exist (${skipped.slice(0, 5).map(fmtCursor).join(", ")}${skipped.length > 5 ? ", ..." : ""})`
        )
      }
    }
    this.checkedJumps = this.jumps.length
  }
}

type Phase =
  /** Not attached: no event of the session may arrive. */
  | { readonly kind: "detached" }
  /** An attach was sent; until its response, events still belong to the earlier attachment. */
  | { readonly kind: "attaching"; readonly previous: Phase; readonly resumeCursor: Cursor | undefined }
  /** The attach response came with a baseline to stream: frames, then `session_attached`. */
  | { readonly kind: "awaitFrames"; readonly lastAtAttach: Cursor | undefined }
  /** Frames came (or none were needed): `session_attached` is next. */
  | { readonly kind: "awaitAttached"; readonly next: Expectation; readonly lastAtAttach: Cursor | undefined }
  /** Attached: events flow. */
  | { readonly kind: "flowing"; readonly next: Expectation; readonly lastAtAttach: Cursor | undefined }
  /** A snapshot is streaming (attach, resync or replacement): no event until its end. */
  | {
    readonly kind: "snapshot"
    readonly purpose: string
    readonly snapshotId: string
    readonly cursor: Cursor | undefined
    readonly messageCount: number
    readonly messages: Array<FoldedMessage>
    chunks: number
    readonly attaching: boolean
    readonly lastAtAttach: Cursor | undefined
  }
  /** The session was closed (`session_closed`): nothing more. */
  | { readonly kind: "closed" }

/** What the next event must be. */
type Expectation =
  /** The successor of this cursor (same generation + 1, or sequence 0 of a later one). */
  | { readonly kind: "after"; readonly cursor: Cursor }
  /** The first event after a baseline whose snapshot ends at `cursor`: sequence 0 of a later generation. */
  | { readonly kind: "start"; readonly cursor: Cursor | undefined }

/**
 * One client's view of one session across its attaches (on one or several connections: a
 * client that reconnects keeps its fold and its last cursor, as a real client does).
 */
export class SessionStream {
  private phase: Phase = { kind: "detached" }
  /** The client's folded transcript; undefined until a baseline or a resume gives one. */
  fold: Array<FoldedMessage> | undefined
  /** The last sequenced event received (what a resume would start after). */
  last: Cursor | undefined
  /** How many `resync`/`replacement` snapshots replaced this client's state. */
  resyncs = 0
  /** Sequenced events received. */
  events = 0
  /** The replay status (and reason) of the last successful attach. */
  lastReplayStatus: string | undefined
  /** Recent messages, for failure output. */
  private readonly recent: Array<string> = []
  /** Called for every sequenced event accepted (drivers watch their turns through it). */
  onEvent: ((m: Msg) => void) | undefined

  constructor(readonly activeSessionId: string, readonly label: string, private readonly truth: Truth) {}

  get attached(): boolean {
    return this.phase.kind !== "detached" && this.phase.kind !== "closed"
  }

  get closed(): boolean {
    return this.phase.kind === "closed"
  }

  /** Attached, no snapshot streaming: the fold is the client's whole state. */
  get settled(): boolean {
    return this.phase.kind === "flowing"
  }

  private fail(invariant: string, what: string): never {
    throw new Violation(invariant, `[${this.label} / ${this.activeSessionId}] ${what}; last messages: ${this.recent.join(", ")}`)
  }

  /** The last few messages received, described. */
  recentMessages(): ReadonlyArray<string> {
    return this.recent
  }

  private note(m: Msg): void {
    this.recent.push(describeMsg(m))
    if (this.recent.length > 40) this.recent.shift()
  }

  /** The client sent `attach` (with this resume cursor, if any). */
  attachSent(resumeCursor: Cursor | undefined): void {
    if (this.phase.kind === "closed") return
    this.phase = { kind: "attaching", previous: this.phase, resumeCursor }
  }

  /** The client's connection dropped: whatever was attached is gone. */
  connectionLost(): void {
    if (this.phase.kind === "closed") return
    this.phase = { kind: "detached" }
  }

  /** `detach` was answered. */
  detached(): void {
    if (this.phase.kind === "closed") return
    this.phase = { kind: "detached" }
  }

  /** The response to this client's attach. */
  attachResponse(r: Msg): void {
    const phase = this.phase
    if (phase.kind !== "attaching") this.fail("attach order", `an attach response without an attach in flight (${phase.kind})`)
    if (r["success"] !== true) {
      this.phase = phase.previous
      return
    }
    const data = r["data"] as Msg
    const replay = data["replay"] as Msg
    const lastAtAttach = data["lastEventCursor"] as Cursor | undefined
    this.lastReplayStatus = replay["reason"] === undefined ? replay["status"] : `${replay["status"]}/${replay["reason"]}`
    if (replay["status"] === "complete") {
      const from = phase.resumeCursor
      if (from === undefined) this.fail("replay decision", "replay complete for an attach without a resume cursor")
      if (this.fold === undefined || this.last === undefined || compareCursor(this.last, from) !== 0) {
        // The harness resumes only from the client's own last cursor.
        this.fail("harness", `resumed from ${fmtCursor(from)} but the client's last cursor is ${fmtCursor(this.last)}`)
      }
      if ((data["snapshot"]?.messages?.length ?? 0) !== 0) this.fail("replay complete", "a complete replay came with snapshot messages")
      if (data["snapshotStream"] !== undefined) this.fail("replay complete", "a complete replay came with a snapshot stream")
      this.phase = { kind: "awaitAttached", next: { kind: "after", cursor: from }, lastAtAttach }
      return
    }
    if (phase.resumeCursor !== undefined && replay["status"] === "partial" && replay["reason"] !== "cursor_expired" && replay["reason"] !== "transcript_replaced") {
      this.fail("replay decision", `partial with reason ${replay["reason"]}`)
    }
    if (data["snapshotStream"] !== undefined) {
      this.phase = { kind: "awaitFrames", lastAtAttach }
      return
    }
    const snap = data["snapshot"] as Msg
    const messages = (snap["messages"] as Array<Msg>).map(foldedOf)
    if (snap["messageCount"] !== messages.length) this.fail("attach baseline", `snapshot.messageCount ${snap["messageCount"]} but ${messages.length} messages inline`)
    this.baseline(messages)
    this.last = snap["cursor"] as Cursor | undefined
    this.phase = { kind: "awaitAttached", next: { kind: "start", cursor: snap["cursor"] as Cursor | undefined }, lastAtAttach }
  }

  /** A snapshot's messages replace the client's state. */
  private baseline(messages: Array<FoldedMessage>): void {
    this.fold = messages
  }

  /** Any message of this session other than a response. */
  receive(m: Msg): void {
    this.note(m)
    const type = m["type"] as string
    if (isSequenced(m)) return this.sequenced(m)
    if (type === "session_attached") {
      if (this.phase.kind !== "awaitAttached") this.fail("attach order", `session_attached in phase ${this.phase.kind}`)
      this.phase = { kind: "flowing", next: this.phase.next, lastAtAttach: this.phase.lastAtAttach }
      return
    }
    if (isSnapshotFrame(m)) return this.frame(m)
  }

  private frame(m: Msg): void {
    if (this.phase.kind === "attaching") {
      // Frames of the attachment being replaced, sent before the daemon took the new attach:
      // they belong to the earlier phase (as its events do), the new attach's come after its response.
      const attaching = this.phase
      this.phase = attaching.previous
      try {
        this.frame(m)
      } finally {
        this.phase = { ...attaching, previous: this.phase }
      }
      return
    }
    const type = m["type"] as string
    const phase = this.phase
    if (type === "session_snapshot_begin") {
      const purpose = m["purpose"] as string
      if (phase.kind === "awaitFrames") {
        if (purpose !== "attach" && purpose !== "resync" && purpose !== "replacement") this.fail("snapshot frames", `purpose ${purpose} for an attach`)
      } else if (phase.kind === "flowing") {
        if (purpose !== "resync" && purpose !== "replacement") this.fail("snapshot frames", `an unsolicited snapshot with purpose ${purpose}`)
      } else {
        this.fail("snapshot frames", `snapshot_begin in phase ${phase.kind}`)
      }
      this.phase = {
        kind: "snapshot",
        purpose,
        snapshotId: String(m["snapshotId"]),
        cursor: m["cursor"] as Cursor | undefined,
        messageCount: m["messageCount"] as number,
        messages: [],
        chunks: 0,
        attaching: phase.kind === "awaitFrames",
        lastAtAttach: phase.lastAtAttach
      }
      return
    }
    if (type === "session_snapshot_failed" && phase.kind === "flowing") {
      // A resync that could not even begin: the client attaches again.
      this.phase = { kind: "detached" }
      return
    }
    if (phase.kind !== "snapshot") this.fail("snapshot frames", `${type} outside a snapshot (${phase.kind})`)
    if (m["snapshotId"] !== phase.snapshotId) this.fail("snapshot frames", `${type} of ${m["snapshotId"]} inside ${phase.snapshotId}`)
    if (type === "session_snapshot_chunk") {
      if (m["index"] !== phase.chunks) this.fail("snapshot frames", `chunk ${m["index"]}, expected ${phase.chunks}`)
      phase.chunks++
      for (const x of m["messages"] as Array<Msg>) phase.messages.push(foldedOf(x))
      return
    }
    if (type === "session_snapshot_failed") {
      // The client must attach again; the harness does (from no cursor).
      this.phase = { kind: "detached" }
      return
    }
    // end
    if (m["chunkCount"] !== phase.chunks) this.fail("snapshot frames", `end says ${m["chunkCount"]} chunks, ${phase.chunks} came`)
    if (phase.messages.length !== phase.messageCount) this.fail("snapshot frames", `begin says ${phase.messageCount} messages, ${phase.messages.length} came`)
    this.baseline(phase.messages)
    // The client's state is now the snapshot: a resume starts after the snapshot's cursor, not
    // after an event seen before it (an event the snapshot rewound, or one before a resync).
    this.last = phase.cursor
    if (phase.purpose !== "attach") this.resyncs++
    const next: Expectation = { kind: "start", cursor: phase.cursor }
    this.phase = phase.attaching
      ? { kind: "awaitAttached", next, lastAtAttach: phase.lastAtAttach }
      : { kind: "flowing", next, lastAtAttach: phase.lastAtAttach }
  }

  private sequenced(m: Msg): void {
    const c = m["meta"]?.cursor as Cursor | undefined
    if (c === undefined || !Number.isInteger(c.generation) || !Number.isInteger(c.sequence)) this.fail("event shape", `${describeMsg(m)} has no valid meta.cursor`)
    const where = `[${this.label}] ${describeMsg(m)}`
    let phase = this.phase
    if (phase.kind === "attaching") phase = phase.previous
    if (phase.kind !== "flowing") this.fail("attach order", `sequenced event ${describeMsg(m)} in phase ${phase.kind}`)
    this.truth.see(m, where)
    const next = phase.next
    if (next.kind === "after") {
      const p = next.cursor
      const sameGen = c.generation === p.generation && c.sequence === p.sequence + 1
      const laterGen = c.generation > p.generation && c.sequence === 0
      if (!sameGen && !laterGen) this.fail("cursor order, each once, no gap", `${describeMsg(m)} does not follow ${fmtCursor(p)}`)
      if (laterGen) this.truth.jumps.push({ from: p, to: c, where: `${where} (after ${this.recent.slice(-6, -1).join(", ")})` })
    } else {
      if (c.sequence !== 0 || (next.cursor !== undefined && c.generation <= next.cursor.generation)) {
        this.fail("no gap after a baseline", `${describeMsg(m)} is not the start of a generation after the snapshot's cursor ${fmtCursor(next.cursor)}`)
      }
      this.truth.jumps.push({ from: next.cursor, to: c, where: `${where} (after ${this.recent.slice(-40, -1).join(", ")})` })
    }
    if (phase.lastAtAttach !== undefined && compareCursor(c, phase.lastAtAttach) <= 0 && m["meta"].replayed !== true) {
      this.fail("replayed flag", `${describeMsg(m)} existed at attach (last ${fmtCursor(phase.lastAtAttach)}) but is not flagged replayed`)
    }
    const flowing: Phase = { kind: "flowing", next: { kind: "after", cursor: c }, lastAtAttach: phase.lastAtAttach }
    if (this.phase.kind === "attaching") this.phase = { ...this.phase, previous: flowing }
    else this.phase = flowing
    this.last = c
    this.events++
    if (m["type"] === "session_event" && m["event"]?.type === "message_end") this.fold?.push(foldedOf(m["event"].message))
    if (m["type"] === "session_closed") this.phase = { kind: "closed" }
    this.onEvent?.(m)
  }
}
