/**
 * The session's own working directory (`<stateDir>/sessions/<id>/work`), which a worker
 * provides while it starts a session's engine. Engines read it with `Effect.serviceOption`, so
 * an engine that has no use for it (or runs where there is none, as in tests) needs nothing.
 */
import * as Context from "effect/Context"

/** The directory a session's tools work in when its config names none. */
export class SessionWorkDir extends Context.Tag("agentd/SessionWorkDir")<SessionWorkDir, string>() {}
