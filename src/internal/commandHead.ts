/**
 * What can be read of a command from the first bytes of its line: its `id` and its command type.
 * The server answers a line over `maxLineBytes` without ever holding the whole of it, so its
 * `line_too_long` response can only echo what its head holds (docs/protocol.md section 9,
 * Framing).
 *
 * A small JSON tokenizer, iterative (a head of nested brackets cannot overflow the stack),
 * linear in the head, that never throws. It reads the head as a prefix of one JSON object and
 * stops at its end, at the end of the text, or at the first byte that is not JSON. It keeps:
 * - the top-level `id` and `type` (each as `JSON.parse` would give it: the last occurrence
 *   wins, and an occurrence whose value has started but not ended makes it unknown);
 * - the `type` of the top-level `command` object (the envelope's command), read while the
 *   `command` object itself is still open: the envelope of a large prompt never ends within the
 *   head, but its command type comes before the message.
 * Keys are compared decoded (`"\u0069d"` is `id`); values are taken only when they are strings.
 */

/** The id (null when it cannot be read) and the command type (`"parse"` when it cannot be read). */
export interface CommandHead {
  readonly id: string | null
  readonly command: string
}

const UNREADABLE: CommandHead = { id: null, command: "parse" }

/** A value that is not a string: it makes a field of interest unreadable. */
const OTHER = Symbol("other")

type Role = "top" | "command" | "other"

interface Frame {
  readonly kind: "object" | "array"
  readonly role: Role
  /** The key of the member being read (objects). */
  key: string | undefined
}

const enum State {
  /** A value is expected. */
  Value,
  /** A value or `]` (just after `[`). */
  ValueOrClose,
  /** A key is expected (after `,` in an object). */
  Key,
  /** A key or `}` (just after `{`). */
  KeyOrClose,
  /** `:` is expected. */
  Colon,
  /** `,` or the closing bracket is expected. */
  AfterValue
}

const NUMBER = /-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/y
const HEX = /^[0-9a-fA-F]{4}$/

const isWhitespace = (c: number): boolean => c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d

/**
 * The end (index after the closing quote) of the JSON string starting at `start` (a `"`), or -1
 * when it does not end within `text` or is not valid JSON (a raw control character, a bad escape).
 */
const stringEnd = (text: string, start: number): number => {
  const n = text.length
  let i = start + 1
  while (i < n) {
    const c = text.charCodeAt(i)
    if (c === 0x22) return i + 1
    if (c < 0x20) return -1
    if (c === 0x5c) {
      if (i + 1 >= n) return -1
      const e = text[i + 1]!
      if (e === "u") {
        if (!HEX.test(text.slice(i + 2, i + 6))) return -1
        i += 6
      } else if ("\"\\/bfnrt".includes(e)) {
        i += 2
      } else {
        return -1
      }
    } else {
      i++
    }
  }
  return -1
}

/** A valid JSON string's value (its escapes already checked). */
const decodeString = (text: string, start: number, end: number): string => JSON.parse(text.slice(start, end)) as string

/**
 * Reads the `id` and command type of a command line from its first characters (a whole line,
 * or any prefix of one). See the module's comment for what counts as readable.
 */
export const scanCommandHead = (text: string): CommandHead => {
  const n = text.length
  let i = 0
  while (i < n && isWhitespace(text.charCodeAt(i))) i++
  // Not an object (or nothing of it yet): neither an id nor a type can be read.
  if (text.charCodeAt(i) !== 0x7b) return UNREADABLE

  let id: string | null = null
  let type: string | null = null
  let innerType: string | null = null
  const stack: Array<Frame> = []

  /** The role of an object or array that starts now as the current member's value. */
  const childRole = (): Role => {
    const parent = stack[stack.length - 1]
    if (parent === undefined) return "top"
    return parent.role === "top" && parent.key === "command" ? "command" : "other"
  }
  /** A value of the current member starts: what it replaces is unknown until it ends. */
  const valueStarts = () => {
    const frame = stack[stack.length - 1]
    if (frame === undefined || frame.kind !== "object") return
    if (frame.role === "top") {
      if (frame.key === "id") id = null
      else if (frame.key === "type") type = null
      else if (frame.key === "command") innerType = null
    } else if (frame.role === "command" && frame.key === "type") {
      innerType = null
    }
  }
  /** The current member's value ended; `value` is it when it is a string. */
  const valueEnds = (value: string | typeof OTHER) => {
    if (value === OTHER) return
    const frame = stack[stack.length - 1]
    if (frame === undefined || frame.kind !== "object") return
    if (frame.role === "top") {
      if (frame.key === "id") id = value
      else if (frame.key === "type") type = value
    } else if (frame.role === "command" && frame.key === "type") {
      innerType = value
    }
  }
  /** Whether the value of the current member is one this scanner keeps (then it is decoded). */
  const wanted = (): boolean => {
    const frame = stack[stack.length - 1]
    if (frame === undefined || frame.kind !== "object") return false
    return (frame.role === "top" && (frame.key === "id" || frame.key === "type")) ||
      (frame.role === "command" && frame.key === "type")
  }

  let state = State.Value
  scan: while (true) {
    while (i < n && isWhitespace(text.charCodeAt(i))) i++
    if (i >= n) break
    const c = text.charCodeAt(i)
    switch (state) {
      case State.ValueOrClose:
      case State.Value: {
        if (state === State.ValueOrClose && c === 0x5d) {
          stack.pop()
          i++
          if (stack.length === 0) break scan
          state = State.AfterValue
          valueEnds(OTHER)
          break
        }
        valueStarts()
        if (c === 0x7b || c === 0x5b) {
          stack.push({ kind: c === 0x7b ? "object" : "array", role: childRole(), key: undefined })
          i++
          state = c === 0x7b ? State.KeyOrClose : State.ValueOrClose
          break
        }
        if (c === 0x22) {
          const end = stringEnd(text, i)
          if (end === -1) break scan
          valueEnds(wanted() ? decodeString(text, i, end) : OTHER)
          i = end
          state = State.AfterValue
          break
        }
        let end = -1
        for (const literal of ["true", "false", "null"]) {
          if (text.startsWith(literal, i)) end = i + literal.length
        }
        if (end === -1) {
          NUMBER.lastIndex = i
          if (NUMBER.test(text)) end = NUMBER.lastIndex
        }
        // A token that reaches the end of the text may go on past it (`12` of `123`).
        if (end === -1 || end >= n) break scan
        valueEnds(OTHER)
        i = end
        state = State.AfterValue
        break
      }
      case State.KeyOrClose:
      case State.Key: {
        const frame = stack[stack.length - 1]!
        if (state === State.KeyOrClose && c === 0x7d) {
          stack.pop()
          i++
          if (stack.length === 0) break scan
          state = State.AfterValue
          valueEnds(OTHER)
          break
        }
        if (c !== 0x22) break scan
        const end = stringEnd(text, i)
        if (end === -1) break scan
        frame.key = decodeString(text, i, end)
        i = end
        state = State.Colon
        break
      }
      case State.Colon: {
        if (c !== 0x3a) break scan
        i++
        state = State.Value
        break
      }
      case State.AfterValue: {
        const frame = stack[stack.length - 1]!
        if (c === 0x2c) {
          i++
          state = frame.kind === "object" ? State.Key : State.Value
          break
        }
        if (c !== (frame.kind === "object" ? 0x7d : 0x5d)) break scan
        stack.pop()
        i++
        if (stack.length === 0) break scan
        valueEnds(OTHER)
        break
      }
    }
  }
  const command = type === "command" ? innerType ?? "parse" : type ?? "parse"
  return { id, command }
}
