/**
 * Follows one session with the Effect client and prints every event once, in order, until the
 * session is closed. Kill the daemon and start it again meanwhile: the follower reconnects,
 * resumes after the last event it printed, and goes on. With a cursor file, a new run goes on
 * where the last one stopped.
 *
 *   node dist/examples/follow.js <activeSessionId> [cursor-file]
 */
import { Cursor, type FollowEvent, SessionClient } from "agentd/client"
import * as Console from "effect/Console"
import * as Effect from "effect/Effect"
import * as Stream from "effect/Stream"

const [activeSessionId, cursorFile] = process.argv.slice(2)
if (activeSessionId === undefined) {
  console.error("usage: follow <activeSessionId> [cursor-file]")
  process.exit(2)
}

/** One line per event: its cursor, then what it says. */
const describe = (e: FollowEvent): string => {
  switch (e.type) {
    case "baseline":
      return `baseline ${e.purpose}: ${e.messages.length} messages${e.cursor === undefined ? "" : ` up to ${Cursor.format(e.cursor)}`}`
    case "session_status":
      return `${Cursor.format(e.meta.cursor)} status busy=${e.state.busy} worker=${e.state.worker}`
    case "session_closed":
      return `${Cursor.format(e.meta.cursor)} closed ${e.reason}`
    case "session_event": {
      const event = e.event
      const detail = event.type === "message_update"
        ? JSON.stringify(event.delta)
        : event.type === "message_end"
        ? `${event.message.role}: ${JSON.stringify(event.message.content)}`
        : event.type === "turn_interrupted"
        ? event.reason
        : ""
      return `${Cursor.format(e.meta.cursor)} ${event.type} ${detail}`.trimEnd()
    }
  }
}

const program = Effect.gen(function*() {
  const follower = yield* SessionClient.make({ activeSessionId, persistPath: cursorFile })
  // Reconnects (default: backoff from 50 ms to 2 s, forever) whenever the daemon goes away.
  yield* follower.events.pipe(Stream.runForEach((event) => Console.log(describe(event))))
  // The stream ends after `session_closed`; the folded state is the session's last.
  const state = yield* follower.state
  yield* Console.log(`transcript: ${state.messages.length} messages`)
})

Effect.runPromise(program).catch((error: unknown) => {
  console.error(`follow failed: ${String(error)}`)
  process.exit(1)
})
