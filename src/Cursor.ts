/**
 * Event cursors: `{ generation, sequence }`, ordered lexicographically (docs/protocol.md section 4).
 *
 * A session starts at generation 1; every checkpoint starts a new generation whose sequence
 * restarts at 0. The supervisor assigns cursors in one place (EventLog.append).
 */
import * as Order from "effect/Order"
import * as Schema from "effect/Schema"

/** A non-negative safe integer. */
const NonNegativeInt = Schema.Int.pipe(Schema.nonNegative())

/** The schema of a cursor as it travels on the wire. */
export const Cursor = Schema.Struct({
  generation: Schema.Int.pipe(Schema.greaterThanOrEqualTo(1)),
  sequence: NonNegativeInt
})

/** A position in a session's event history. */
export type Cursor = typeof Cursor.Type

/** Builds a cursor (no validation: use the schema for untrusted input). */
export const make = (generation: number, sequence: number): Cursor => ({ generation, sequence })

/** The cursor of the first event of a session. */
export const initial: Cursor = make(1, 0)

/** Lexicographic order: generation first, then sequence. */
export const Order_: Order.Order<Cursor> = Order.combine(
  Order.mapInput(Order.number, (c: Cursor) => c.generation),
  Order.mapInput(Order.number, (c: Cursor) => c.sequence)
)
export { Order_ as Order }

/** `-1`, `0` or `1` as `a` is before, equal to or after `b`. */
export const compare = (a: Cursor, b: Cursor): -1 | 0 | 1 => Order_(a, b)

/** True when `a` comes strictly after `b`. */
export const isAfter = (a: Cursor, b: Cursor): boolean => Order_(a, b) === 1

/** True when `a` comes strictly before `b`. */
export const isBefore = (a: Cursor, b: Cursor): boolean => Order_(a, b) === -1

/** True when both name the same event. */
export const equals = (a: Cursor, b: Cursor): boolean => a.generation === b.generation && a.sequence === b.sequence

/** The cursor of the next event in the same generation. */
export const next = (c: Cursor): Cursor => make(c.generation, c.sequence + 1)

/** The cursor of the first event of the generation after `c`'s. */
export const nextGeneration = (c: Cursor): Cursor => make(c.generation + 1, 0)

/** The later of two cursors. */
export const max = Order.max(Order_)

/** `g:s`, for logs and messages. */
export const format = (c: Cursor): string => `${c.generation}:${c.sequence}`
