/**
 * What a session's entity takes from its mailbox (`Input`): commands with their Deferreds, the
 * worker's frames and exit with its handle, timers. The entity names the requests and workers
 * of these inputs by plain ids and hands them to `step` (transition.ts), which owns the
 * lifecycle; nothing here is state.
 *
 * Owns: the inputs' shapes, `CommandTakesEffect`, and the mailbox itself (`InputQueue`).
 */
import * as Deferred from "effect/Deferred"
import * as Effect from "effect/Effect"
import * as FiberRef from "effect/FiberRef"
import type { SessionSummary } from "../../Protocol.js"
import type { CoreError } from "./errors.js"
import type { WorkerExit, WorkerHandle } from "../../WorkerPool.js"
import type * as WorkerProtocol from "../../WorkerProtocol.js"

export type CheckpointReply = Deferred.Deferred<{ generation: number; snapshotId: string }, CoreError>

/**
 * How far a command has got in its session, for a caller that takes commands one after another
 * but lets their answers come as they may (the socket server, per connection):
 * - `taken`: the command has taken effect, its input stepped by the entity (a prompt reserved or
 *   its turn begun, an abort sent, a checkpoint taken or waiting for the turn's end, a kill
 *   decided), often long before its answer and before the writes that step asked for. The next
 *   command to another session need not wait for more: one to the same session queues behind it
 *   in the session's mailbox anyway.
 * - `settled`: those writes are done too (a prompt's busy record and status logged): what a
 *   command that reads the session (`get_state`, `list`) then sees includes this one's effect.
 */
export interface CommandProgress {
  readonly taken: Deferred.Deferred<void>
  readonly settled: Deferred.Deferred<void>
}

/** Both stages of a command's progress done (it ended, or it has nothing to write). */
export const progressDone = (progress: CommandProgress): Effect.Effect<void> =>
  Effect.zipRight(Deferred.succeed(progress.taken, undefined), Deferred.succeed(progress.settled, undefined))

/** The caller's {@link CommandProgress} for the command it runs, if it follows one. */
export const CommandTakesEffect = FiberRef.unsafeMake<CommandProgress | undefined>(undefined)

/**
 * A session's mailbox: inputs in the order offered, taken one at a time by the session's entity
 * (its only taker). Not an Effect Queue: its `take` made a Deferred for each input the entity
 * waited for, ~8 us of CPU more than this `Effect.async` (a micro-benchmark), paid for every
 * event at a model's pace, when each of a worker's events comes as an input of its own. Nor an
 * Effect Mailbox (~1.6 us more a take): its `takeAll` waits when empty, and a closed entity's
 * mailbox is drained without waiting.
 */
export class InputQueue<A> {
  private items: Array<A> = []
  /** The entity waiting in `take`, if it is. */
  private taker: ((input: A) => void) | undefined
  /**
   * Set by the taker: an input offered while it waits in `take` (nothing queued) is first given
   * to this, which may take it itself, outside the taker's fiber (true), so the taker is not
   * woken; false leaves it to `take`.
   */
  bypass: ((input: A) => boolean) | undefined

  /** Offers an input; never waits. */
  unsafeOffer(input: A): void {
    const taker = this.taker
    if (taker === undefined) {
      this.items.push(input)
      return
    }
    if (this.bypass !== undefined && this.bypass(input)) return
    this.taker = undefined
    taker(input)
  }

  /** The next input, waiting for one. */
  readonly take: Effect.Effect<A> = Effect.async<A>((resume) => {
    if (this.items.length > 0) return resume(Effect.succeed(this.items.shift()!))
    this.taker = (input) => resume(Effect.succeed(input))
    return Effect.sync(() => {
      this.taker = undefined
    })
  })

  /** Every input offered and not taken, in order; the queue is then empty. */
  takeAll(): Array<A> {
    const all = this.items
    this.items = []
    return all
  }
}

/** What every command's input carries. */
interface CommandInput<A> {
  readonly reply: Deferred.Deferred<A, CoreError>
  /** The caller's {@link CommandTakesEffect}, if any. */
  readonly progress: CommandProgress | undefined
}

/** What the entity of a session takes from its mailbox: commands, its worker's frames and exit, timers. */
export type Input =
  | { readonly _tag: "Prompt"; readonly message: string; readonly promptId?: string | undefined } & CommandInput<{ accepted: true }>
  | { readonly _tag: "Abort" } & CommandInput<{ aborted: boolean }>
  | { readonly _tag: "Checkpoint" } & CommandInput<{ generation: number; snapshotId: string }>
  | { readonly _tag: "Retry" } & CommandInput<SessionSummary>
  | { readonly _tag: "Kill" } & CommandInput<{}>
  /** A new name (checked valid by the caller; its claim is the entity's). */
  | { readonly _tag: "Rename"; readonly name: string } & CommandInput<SessionSummary>
  | { readonly _tag: "Passivate" }
  /** An attach set the environment of the session's next worker. */
  | { readonly _tag: "SetEnv"; readonly launchEnv?: Record<string, string>; readonly clientEnv?: Record<string, string> }
  /**
   * The daemon stops gracefully: every command waiting in the session is answered
   * `shutting_down`, and a running turn is cut (`turn_interrupted {daemon_shutdown}`), by its
   * worker, or with `force` by the supervisor itself (the worker did not end it in time).
   * `done` completes once no turn runs.
   */
  | { readonly _tag: "ShuttingDown"; readonly done: Deferred.Deferred<void>; readonly force?: boolean }
  /** At daemon start: the session was running a turn when the last daemon died. */
  | { readonly _tag: "Restore" }
  /** A worker for attempt `epoch`, already sent its `load`. */
  | { readonly _tag: "Acquired"; readonly epoch: number; readonly worker: WorkerHandle }
  | { readonly _tag: "AcquireFailed"; readonly epoch: number; readonly message: string }
  | { readonly _tag: "RestartDue"; readonly epoch: number }
  /** Time to try again to log the end owed to a turn that storage cut (attempt `epoch`). */
  | { readonly _tag: "StorageRetry"; readonly epoch: number }
  | {
    readonly _tag: "Frames"
    readonly worker: WorkerHandle
    readonly frames: ReadonlyArray<WorkerProtocol.ReceivedFrame>
    /** Called once the entity has handled them (or was interrupted handling them). */
    readonly handled: () => void
  }
  | { readonly _tag: "Exited"; readonly worker: WorkerHandle; readonly exit: WorkerExit }
  /**
   * A batch of frames published beside the entity (see the entity's `publishBeside`) failed:
   * the entity takes that failure before anything else (it may have nothing else to take).
   */
  | { readonly _tag: "BesideFailed" }

export type AnyFrame = { readonly type: string; readonly [k: string]: unknown }
