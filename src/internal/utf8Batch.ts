/**
 * Builds one buffer of UTF-8 text from many strings, written one by one into a scratch buffer
 * the process keeps, then copied out at its exact size.
 *
 * Why: a batch of event lines joined with `+=` is a rope of thousands of pieces, and
 * `Buffer.from(rope)` first flattens it (a copy, and garbage) before encoding it. On the
 * daemon's event path (a worker's batch of events, logged, then sent to every client) that was
 * the largest single cost: about 5 us per event, against 0.4 us written piece by piece here.
 *
 * Synchronous only: a batch is begun, filled and taken without yielding (one scratch buffer
 * serves every caller of the process, one at a time).
 */

/** The scratch buffer's usual size; one grown past {@link KEEP_BYTES} for a large batch is dropped after it. */
const INITIAL_BYTES = 256 * 1024
const KEEP_BYTES = 4 * 1024 * 1024

let scratch = Buffer.allocUnsafeSlow(INITIAL_BYTES)
let used = 0

/** Starts a batch (whatever a builder that threw halfway left is dropped). */
export const begin = (): void => {
  used = 0
}

/** Makes room for `bytes` more bytes in the scratch buffer. */
const room = (bytes: number): void => {
  if (scratch.length - used >= bytes) return
  const grown = Buffer.allocUnsafeSlow(Math.max(scratch.length * 2, used + bytes))
  scratch.copy(grown, 0, 0, used)
  scratch = grown
}

/** Appends `text` to the batch, UTF-8 encoded exactly as `Buffer.from(text, "utf8")` would. */
export const put = (text: string): void => {
  // A UTF-16 unit takes at most 3 bytes in UTF-8.
  room(text.length * 3)
  used += scratch.write(text, used, "utf8")
}

/** Appends bytes already encoded (a constant piece: no string to encode each time). */
export const putBytes = (bytes: Uint8Array): void => {
  room(bytes.length)
  scratch.set(bytes, used)
  used += bytes.length
}

/** Appends a piece of text given as a string or as its UTF-8 bytes (an event's part). */
export const putPart = (part: string | Uint8Array): void => (typeof part === "string" ? put(part) : putBytes(part))

/**
 * Appends a non-negative safe integer in decimal, as `String(n)` writes it, without making that
 * string (a cursor's sequence in every record and wire line: a string each was a fifth of what
 * the daemon allocated per event).
 */
export const putUint = (n: number): void => {
  let digits = 1
  for (let x = n; x >= 10; x = Math.floor(x / 10)) digits++
  room(digits)
  let at = used + digits
  let x = n
  do {
    scratch[--at] = 48 + (x % 10)
    x = Math.floor(x / 10)
  } while (x > 0)
  used += digits
}

/** How many bytes were written since `begin`. */
export const size = (): number => used

/**
 * The bytes written since `begin`, as a view of the scratch buffer itself (no copy); ends the
 * batch. The view is valid only until the next `begin`: for a caller that uses it at once,
 * synchronously (a file write), never for bytes that wait (a socket's queue).
 */
export const view = (): Buffer => {
  const out = scratch.subarray(0, used)
  used = 0
  // A scratch grown for a large batch is dropped: the view keeps it alive as long as it is used.
  if (scratch.length > KEEP_BYTES) scratch = Buffer.allocUnsafeSlow(INITIAL_BYTES)
  return out
}

/** The bytes written since `begin`, in a buffer of their own; ends the batch. */
export const take = (): Buffer => {
  const out = Buffer.allocUnsafe(used)
  scratch.copy(out, 0, 0, used)
  used = 0
  if (scratch.length > KEEP_BYTES) scratch = Buffer.allocUnsafeSlow(INITIAL_BYTES)
  return out
}
