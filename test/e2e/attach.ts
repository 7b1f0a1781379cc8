/**
 * Attach helpers shared by the e2e files: check an attach result, attach and consume the
 * replayed events, compare replayed with live events.
 */
import { expect } from "vitest"
import {
  agentMessageProblems,
  type Client,
  compareCursor,
  type Cursor,
  cursorOf,
  cursorProblems,
  isSequenced,
  type Msg,
  PROTOCOL,
  summaryProblems
} from "./harness.js"

/** Strips `meta.replayed` so a replayed event can be compared with its live original. */
export const unflag = (m: Msg): Msg => {
  const { replayed: _r, ...meta } = m["meta"] ?? {}
  return { ...m, meta }
}

/** Problems of an attach response's data (section 5). */
export const attachProblems = (data: Msg, opts: { id: string; clientId: string; slim?: boolean }): Array<string> => {
  const out: Array<string> = []
  if (JSON.stringify(data["protocol"]) !== JSON.stringify(PROTOCOL)) out.push(`protocol: ${JSON.stringify(data["protocol"])}`)
  if (data["activeSessionId"] !== opts.id) out.push("activeSessionId")
  const snap = data["snapshot"]
  if (typeof snap !== "object" || snap === null) out.push("snapshot missing")
  else {
    if (typeof snap.snapshotId !== "string") out.push("snapshot.snapshotId")
    if (!Number.isInteger(snap.messageCount)) out.push("snapshot.messageCount")
    if (!Array.isArray(snap.messages)) out.push("snapshot.messages")
    if ("cursor" in snap) out.push(...cursorProblems(snap.cursor, "snapshot.cursor"))
    for (const [i, m] of (snap.messages ?? []).entries()) out.push(...agentMessageProblems(m, `snapshot.messages[${i}]`))
  }
  const replay = data["replay"]
  if (!["complete", "partial", "unavailable"].includes(replay?.status)) out.push(`replay.status: ${replay?.status}`)
  if (!Number.isInteger(data["lastEventSequence"]) || data["lastEventSequence"] < -1) out.push("lastEventSequence")
  if ("lastEventCursor" in data) {
    out.push(...cursorProblems(data["lastEventCursor"], "lastEventCursor"))
    if (data["lastEventCursor"]?.sequence !== data["lastEventSequence"]) out.push("lastEventSequence must be lastEventCursor.sequence")
  } else if (data["lastEventSequence"] !== -1) out.push("lastEventSequence must be -1 without lastEventCursor")
  if (opts.slim === true) {
    if ("state" in data) out.push("state must be left out under slim_attach")
    if ("messages" in data) out.push("messages must be left out under slim_attach")
  } else {
    out.push(...summaryProblems(data["state"], "attach.state"))
    if (JSON.stringify(data["messages"]) !== JSON.stringify(snap?.messages)) out.push("top-level messages must equal snapshot.messages")
  }
  if (data["client"]?.id !== opts.clientId) out.push(`client.id ${data["client"]?.id} != hello clientId ${opts.clientId}`)
  if (!Array.isArray(data["client"]?.capabilities)) out.push("client.capabilities")
  return out
}

/**
 * Attaches `client` and returns the response data, the session_attached message and the
 * replayed events that follow it (up to `lastEventCursor`).
 */
export const attachAndReplay = async (
  client: Client,
  command: Msg
): Promise<{ data: Msg; attached: Msg; replayed: Array<Msg>; response: Msg }> => {
  const response = await client.request({ type: "attach", ...command }, 30_000)
  if (response["success"] !== true) throw new Error(`attach failed: ${JSON.stringify(response["error"])}`)
  const data = response["data"] as Msg
  const id = command["activeSessionId"] as string
  const attached = await client.waitFor((m) => m["type"] === "session_attached" && m["activeSessionId"] === id, 30_000)
  const replayed: Array<Msg> = []
  const last = data["lastEventCursor"] as Cursor | undefined
  // complete: `eventCount` events follow; a baseline: the events after the snapshot's cursor
  // (those of the current generation), up to the attach-time last event.
  const snapCursor = data["snapshot"]?.cursor as Cursor | undefined
  const noneExpected = data["replay"]?.status === "complete"
    ? (data["replay"]?.eventCount ?? 0) === 0
    : last === undefined || (snapCursor !== undefined && compareCursor(last, snapCursor) <= 0)
  if (last !== undefined && !noneExpected) {
    for (;;) {
      const m = await client.waitFor((x) => isSequenced(x) && x["activeSessionId"] === id, 10_000, "replayed events")
      replayed.push(m)
      if (compareCursor(cursorOf(m), last) >= 0) break
    }
  }
  expect(replayRangeProblems(data["replay"], replayed)).toEqual([])
  return { data, attached, replayed, response }
}

/** `fromCursor`/`toCursor`/`eventCount`, when present, describe exactly the replayed events. */
export const replayRangeProblems = (replay: Msg, replayed: ReadonlyArray<Msg>): Array<string> => {
  const out: Array<string> = []
  const first = replayed[0]
  const last = replayed[replayed.length - 1]
  if ("eventCount" in replay && replay["eventCount"] !== replayed.length) out.push(`eventCount ${replay["eventCount"]} but ${replayed.length} replayed`)
  if ("fromCursor" in replay && JSON.stringify(replay["fromCursor"]) !== JSON.stringify(first?.["meta"]?.cursor)) {
    out.push(`fromCursor ${JSON.stringify(replay["fromCursor"])} but first replayed ${JSON.stringify(first?.["meta"]?.cursor)}`)
  }
  if ("toCursor" in replay && JSON.stringify(replay["toCursor"]) !== JSON.stringify(last?.["meta"]?.cursor)) {
    out.push(`toCursor ${JSON.stringify(replay["toCursor"])} but last replayed ${JSON.stringify(last?.["meta"]?.cursor)}`)
  }
  return out
}

// ---------------------------------------------------------------------------------------------

