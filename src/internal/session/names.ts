/**
 * Session names: unique among live sessions, judged here (a client's check-then-create would
 * race). Each check and its claim happen in one synchronous step, so two racing commands cannot
 * both pass it. Sessions loaded from an older state dir may share a name: they load all the same
 * (addressable by id) and keep it until renamed.
 *
 * Owns: the names claimed by commands under way (a create until its session is registered, a
 * rename until its new name is durable: it holds its old name meanwhile, so that no other
 * session takes a name a failed rename gives back). A session's name itself is in its `meta`,
 * written by its entity alone (the `Rename` action of entity.ts); a create sets it before the
 * session exists.
 */
import type { SessionMeta } from "../../SessionStore.js"
import { CommandError, NameTaken } from "./errors.js"

/** What holds names besides the claims: live sessions (not closed) and damaged ones. */
export interface NameHolders {
  /** The metadata of every live (not closed) session. */
  readonly live: () => Iterable<SessionMeta>
  readonly damaged: () => Iterable<{ readonly activeSessionId: string; readonly name: string | undefined }>
}

export interface Names {
  /** `invalid_command` (naming the `command`'s `name`) for a name no session may have. */
  readonly invalid: (command: string, name: string) => CommandError | undefined
  /**
   * Checks that `name` is free (held by nobody but `except`) and, if so, claims it for `holder`
   * (a session id, or what is under way) in the same synchronous step. Returns the release of
   * the claim, or `NameTaken`.
   */
  readonly claim: (name: string, except: string | undefined, holder: string) => NameTaken | (() => void)
  /** Holds a name its holder has already (a rename's old name while the new one is saved). */
  readonly hold: (name: string, holder: string) => () => void
}

export const makeNames = (holders: NameHolders): Names => {
  /** name -> who claimed it (a session id, or "a session being created"). */
  const claims = new Map<string, string>()

  const holderOf = (name: string, except: string | undefined): string | undefined => {
    for (const meta of holders.live()) {
      if (meta.name === name && meta.activeSessionId !== except) return meta.activeSessionId
    }
    for (const d of holders.damaged()) {
      if (d.name === name && d.activeSessionId !== except) return d.activeSessionId
    }
    const claimer = claims.get(name)
    return claimer === except ? undefined : claimer
  }

  const hold = (name: string, holder: string) => {
    claims.set(name, holder)
    return () => {
      if (claims.get(name) === holder) claims.delete(name)
    }
  }

  return {
    invalid: (command, name) =>
      name.length === 0 || name.trim() !== name || /[\u0000-\u001f\u007f]/.test(name)
        ? new CommandError({
          code: "invalid_command",
          message: `Invalid \`${command}\` command: \`name\`: a name is not empty and has no control characters or surrounding spaces.`
        })
        : undefined,
    claim: (name, except, holder) => {
      const taken = holderOf(name, except)
      if (taken === undefined) return hold(name, holder)
      return new NameTaken({
        message: `The name ${JSON.stringify(name)} is in use by ${taken.startsWith("s-") ? `session \`${taken}\`` : taken}.`
      })
    },
    hold
  }
}
