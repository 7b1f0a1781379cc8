/**
 * The id and command type read from the head of a line too long to keep (internal/commandHead):
 * a table of the cases that a regex or a naive scanner gets wrong (nested ids, escaped keys,
 * strings holding quotes and braces, duplicate keys, truncation inside a value, deep nesting),
 * and properties against `JSON.parse` of whole lines and of every cut of a line.
 */
import { assert, describe, it } from "@effect/vitest"
import * as FastCheck from "effect/FastCheck"
import { scanCommandHead } from "../src/internal/commandHead.js"
import * as Protocol from "../src/Protocol.js"

const isRecord = (u: unknown): u is Record<string, unknown> => typeof u === "object" && u !== null && !Array.isArray(u)

/** What the server reads of a whole line that `JSON.parse` accepts (section 3's rules). */
const reference = (value: unknown): { id: string | null; command: string } => {
  if (!isRecord(value)) return { id: null, command: "parse" }
  const id = typeof value["id"] === "string" ? value["id"] : null
  if (value["type"] === "command") {
    const inner = value["command"]
    return { id, command: isRecord(inner) && typeof inner["type"] === "string" ? inner["type"] : "parse" }
  }
  return { id, command: typeof value["type"] === "string" ? value["type"] : "parse" }
}

describe("scanCommandHead: table", () => {
  const pad = "a".repeat(1000)
  const cases: ReadonlyArray<readonly [string, string, string | null, string]> = [
    ["a bare command cut in its padding", `{"id":"x","type":"ping","pad":"${pad}`, "x", "ping"],
    [
      "an envelope cut in its prompt's message",
      `{"type":"command","id":"r1","protocol":{"name":"agentd","version":1},"clientId":"c","command":{"type":"prompt","activeSessionId":"s","message":"${pad}`,
      "r1",
      "prompt"
    ],
    ["an id nested before the top-level one", `{"meta":{"id":"inner","type":"x"},"id":"outer","type":"ping","p":"${pad}`, "outer", "ping"],
    ["an id only inside an array", `{"a":[{"id":"no"}],"type":"ping","p":"${pad}`, null, "ping"],
    ["an escaped key", `{"\\u0069d":"x","t\\u0079pe":"ping","p":"`, "x", "ping"],
    ["an id with escapes", `{"id":"a\\"b\\\\c\\u00e9\\n","p":"`, "a\"b\\c\u00e9\n", "parse"],
    ["a string that looks like members", `{"p":"\\",\\"id\\":\\"fake\\"}","type":"ping","q":"`, null, "ping"],
    ["braces and brackets inside strings", `{"p":"}{][","id":"x","q":"`, "x", "parse"],
    ["the id after the cut (after a huge field)", `{"type":"ping","pad":"${pad}`, null, "ping"],
    ["the id's value cut", `{"type":"ping","id":"abc`, null, "ping"],
    ["the id's key cut", `{"type":"ping","i`, null, "ping"],
    ["a number id", `{"id":5,"type":"ping","p":"`, null, "ping"],
    ["an object id", `{"id":{"v":"x"},"type":"ping","p":"`, null, "ping"],
    ["a duplicate id: the last wins", `{"id":"a","id":"b","p":"`, "b", "parse"],
    ["a duplicate id cut: unknown", `{"id":"a","type":"ping","id":"bb`, null, "ping"],
    ["a duplicate id that is no string", `{"id":"a","id":null,"p":"`, null, "parse"],
    ["an array", `[{"id":"x","type":"ping"}`, null, "parse"],
    ["a string", `"id"`, null, "parse"],
    ["garbage", `aaaa{"id":"x"`, null, "parse"],
    ["nothing", ``, null, "parse"],
    ["only whitespace", ` \t `, null, "parse"],
    ["leading whitespace", ` \t{ "id" : "x" , "type" : "ping" , "p":"`, "x", "ping"],
    ["a byte order mark", `\ufeff{"id":"x","p":"`, null, "parse"],
    ["an envelope whose type comes last", `{"command":{"type":"prompt","message":"m"},"id":"x","type":"command","p":"`, "x", "prompt"],
    ["an envelope whose command is no object", `{"type":"command","id":"x","command":"prompt","p":"`, "x", "parse"],
    ["an envelope whose command type comes after the cut", `{"type":"command","id":"x","command":{"message":"${pad}`, "x", "parse"],
    ["an envelope whose command has an id", `{"type":"command","command":{"id":"inner","type":"ping"},"id":"outer","p":"`, "outer", "ping"],
    ["a type nested deeper in the command", `{"type":"command","id":"x","command":{"a":{"type":"no"},"p":"`, "x", "parse"],
    ["a number at the cut", `{"id":"x","n":12`, "x", "parse"],
    ["a literal at the cut", `{"id":"x","n":tr`, "x", "parse"],
    ["invalid JSON after the id: what was read stays", `{"id":"x",,"type":"ping"`, "x", "parse"],
    ["invalid JSON before the id", `{"a":01,"id":"x","p":"`, null, "parse"],
    ["a trailing comma", `{"a":[1,],"id":"x","p":"`, null, "parse"],
    ["a bad escape", `{"id":"\\uZZZZ","p":"`, null, "parse"],
    ["a raw control character in the id", `{"id":"a\tb","p":"`, null, "parse"],
    ["a lone surrogate escape", `{"id":"\\ud800","p":"`, "\ud800", "parse"],
    ["a closed object followed by more", `{"id":"x","type":"ping"}   {"id":"y"`, "x", "ping"],
    ["deep nesting before the id", `{"a":${"[".repeat(100_000)}`, null, "parse"],
    ["deep nesting after the id", `{"id":"x","type":"ping","a":${"[{\"k\":".repeat(30_000)}`, "x", "ping"]
  ]
  for (const [name, text, id, command] of cases) {
    it(name, () => {
      assert.deepStrictEqual(scanCommandHead(text), { id, command })
    })
  }
})

/** A JSON value with the keys of interest often present. */
const arbJson: FastCheck.Arbitrary<unknown> = FastCheck.letrec((tie) => ({
  value: FastCheck.oneof(
    { depthSize: "small", withCrossShrink: true },
    FastCheck.constantFrom(null, true, false),
    // JSON has no -0 (it is written 0): a value a line can hold.
    FastCheck.double({ noNaN: true, noDefaultInfinity: true }).map((d) => (Object.is(d, -0) ? 0 : d)),
    FastCheck.fullUnicodeString(),
    FastCheck.constantFrom("command", "ping", "prompt", "id", "type"),
    FastCheck.array(tie("value"), { maxLength: 4 }),
    tie("object")
  ),
  object: FastCheck.dictionary(
    FastCheck.oneof(FastCheck.constantFrom("id", "type", "command", "protocol", "message"), FastCheck.fullUnicodeString()),
    tie("value"),
    { maxKeys: 6 }
  )
})).object

/** Serializes like JSON.stringify, with random whitespace and randomly \u-escaped characters. */
const arbSerialization = (value: unknown): FastCheck.Arbitrary<string> =>
  FastCheck.array(FastCheck.nat(7), { minLength: 64, maxLength: 64 }).map((noise) => {
    let k = 0
    const next = () => noise[k++ % noise.length]!
    const ws = () => ["", "", " ", "\t", "  ", "\r", ""][next() % 7]!
    // Code unit by code unit: a pair split in two escapes still decodes to the pair.
    const str = (s: string) => {
      let out = ""
      for (let i = 0; i < s.length; i++) {
        const c = s[i]!
        out += /[a-z]/.test(c) && next() === 0 ? `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}` : JSON.stringify(c).slice(1, -1)
      }
      return `"${out}"`
    }
    const go = (v: unknown): string => {
      if (Array.isArray(v)) return `[${ws()}${v.map(go).join(`${ws()},${ws()}`)}${ws()}]`
      if (isRecord(v)) return `{${ws()}${Object.entries(v).map(([key, x]) => `${str(key)}${ws()}:${ws()}${go(x)}`).join(`${ws()},${ws()}`)}${ws()}}`
      if (typeof v === "string") return str(v)
      return JSON.stringify(v)
    }
    return `${ws()}${go(value)}`
  })

const arbLine = arbJson.chain((value) => arbSerialization(value).map((text) => ({ value, text })))

describe("scanCommandHead: properties", () => {
  it.prop("a whole line reads as JSON.parse reads it", [arbLine], ([{ text, value }]) => {
    assert.deepStrictEqual(JSON.parse(text), value)
    assert.deepStrictEqual(scanCommandHead(text), reference(value))
  })

  it.prop(
    "every cut of a line reads nothing, or what the whole line holds; once read, it stays read",
    [arbLine],
    ([{ text }]) => {
      const whole = scanCommandHead(text)
      let previous = { id: null as string | null, command: "parse" }
      for (let cut = 0; cut <= text.length; cut++) {
        const got = scanCommandHead(text.slice(0, cut))
        assert.include([null, whole.id], got.id, `cut ${cut}`)
        assert.include(["parse", whole.command], got.command, `cut ${cut}`)
        if (previous.id !== null) assert.strictEqual(got.id, previous.id, `cut ${cut}`)
        if (previous.command !== "parse") assert.strictEqual(got.command, previous.command, `cut ${cut}`)
        previous = got
      }
    },
    { fastCheck: { numRuns: 60 } }
  )

  it.prop(
    "a client's envelope cut anywhere after its message starts gives its id and `prompt`",
    [FastCheck.fullUnicodeString(), FastCheck.fullUnicodeString(), FastCheck.fullUnicodeString({ minLength: 1 }), FastCheck.nat(1000)],
    ([id, clientId, message, extra]) => {
      const line = Protocol.encodeCommand(id, { type: "prompt", activeSessionId: "s-1", message }, clientId).trimEnd()
      const start = line.indexOf(`"message":"`) + `"message":"`.length
      const cut = start + (extra % (line.length - start))
      assert.deepStrictEqual(scanCommandHead(line.slice(0, cut)), { id, command: "prompt" })
    }
  )

  it.prop("never throws, whatever the text", [FastCheck.oneof(FastCheck.fullUnicodeString(), FastCheck.string({ unit: FastCheck.constantFrom(..."{}[]\":,\\ u0aet1-.") }))], ([text]) => {
    const got = scanCommandHead(text)
    assert.isTrue(got.id === null || typeof got.id === "string")
    assert.isString(got.command)
  })

  it.prop("a line prefixed by `{` and members JSON.parse accepts keeps their id through any tail", [arbLine, FastCheck.fullUnicodeString()], ([{ text, value }, tail]) => {
    // `text` without its closing brace, then a new member whose value never ends.
    const open = text.trimEnd()
    if (!isRecord(value) || Object.keys(value).length === 0) return
    const cut = `${open.slice(0, open.length - 1)},"pad":"${JSON.stringify(tail).slice(1, -1)}`
    assert.deepStrictEqual(scanCommandHead(cut), reference(value))
  })
})
