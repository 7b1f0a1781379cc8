/**
 * Session targets, as tmux's `-t`: a session is named by its id, by a unique prefix of its id
 * (the `s-` may be left out), or by its name. The one resolver of the command line and the
 * SDK (`DaemonClient.resolve`, `client.session("name")`), so that a target means the same
 * session everywhere.
 *
 * Rules, best first: an exact id, then an exact name, then an id prefix. A whole id is taken
 * as it is (the daemon is the judge: no `list` is needed). A target that fits several sessions
 * is ambiguous; that happens with a prefix, or with a name shared by sessions created before
 * the daemon kept names unique.
 *
 * Pure and free of Effect: the command line's one-shot commands load it without the runtime.
 */
import type { SessionSummary } from "./Protocol.js"

/** True for a whole session id (`s-` and a UUID): then no `list` is needed. */
export const isFullId = (target: string): boolean =>
  /^s-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/.test(target)

/** The sessions `target` may mean, by the best rule that matches any. */
export const matches = (
  sessions: ReadonlyArray<SessionSummary>,
  target: string
): ReadonlyArray<SessionSummary> => {
  const exact = sessions.filter((s) => s.activeSessionId === target)
  if (exact.length > 0) return exact
  const named = sessions.filter((s) => s.name === target)
  if (named.length > 0) return named
  if (target.length === 0) return []
  const prefix = target.startsWith("s-") ? target : `s-${target}`
  return sessions.filter((s) => s.activeSessionId.startsWith(prefix))
}

/** What a target names among the sessions. */
export type Resolution =
  | { readonly _tag: "Found"; readonly activeSessionId: string }
  | { readonly _tag: "NoMatch"; readonly message: string }
  | { readonly _tag: "Ambiguous"; readonly message: string; readonly candidates: ReadonlyArray<SessionSummary> }

/** The one session `target` names among `sessions`, or why there is not one. */
export const resolve = (sessions: ReadonlyArray<SessionSummary>, target: string): Resolution => {
  const found = matches(sessions, target)
  if (found.length === 1) return { _tag: "Found", activeSessionId: found[0]!.activeSessionId }
  if (found.length === 0) {
    return {
      _tag: "NoMatch",
      message: `no session matches ${JSON.stringify(target)} (an id, a unique prefix of one, or a name)`
    }
  }
  return {
    _tag: "Ambiguous",
    message: `${JSON.stringify(target)} matches ${found.length} sessions; name one by a longer prefix of its id`,
    candidates: found
  }
}
