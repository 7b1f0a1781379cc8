/**
 * Session targets, as tmux's `-t`: a session is named by its id, by a unique prefix of its id
 * (the `s-` may be left out), or by its name. An exact id wins, then an exact name, then a
 * prefix; a target that fits several sessions is refused with the list of them.
 */
import * as Effect from "effect/Effect"
import type { DaemonClientService, RequestError } from "../DaemonClient.js"
import type * as Protocol from "../Protocol.js"
import { type CliError, failed } from "./errors.js"
import { shortDate } from "./render.js"

/** A whole session id: then no `list` is needed, the daemon is the judge. */
const FULL_ID = /^s-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/

/** The sessions `target` may mean, best rule first (pure; exported for tests). */
export const matches = (
  sessions: ReadonlyArray<Protocol.SessionSummary>,
  target: string
): ReadonlyArray<Protocol.SessionSummary> => {
  const exact = sessions.filter((s) => s.activeSessionId === target)
  if (exact.length > 0) return exact
  const named = sessions.filter((s) => s.name === target)
  if (named.length > 0) return named
  if (target.length === 0) return []
  const prefix = target.startsWith("s-") ? target : `s-${target}`
  return sessions.filter((s) => s.activeSessionId.startsWith(prefix))
}

const candidate = (s: Protocol.SessionSummary) =>
  `  ${s.activeSessionId}  ${s.name ?? "-"}  created ${shortDate(s.createdAt)}  ${s.messageCount} messages`

/** The session id `target` names, or why it names none or several. */
export const resolve = (client: DaemonClientService, target: string): Effect.Effect<string, CliError | RequestError> =>
  FULL_ID.test(target)
    ? Effect.succeed(target)
    : Effect.flatMap(client.list(), ({ sessions }) => {
      const found = matches(sessions, target)
      if (found.length === 1) return Effect.succeed(found[0]!.activeSessionId)
      if (found.length === 0) {
        return Effect.fail(failed(`no session matches ${JSON.stringify(target)} (an id, a unique prefix of one, or a name; see \`agentd sessions\`)`))
      }
      return Effect.fail(
        failed(`${JSON.stringify(target)} matches ${found.length} sessions; name one by a longer prefix of its id:\n${found.map(candidate).join("\n")}`)
      )
    })
