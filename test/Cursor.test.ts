import { assert, describe, it } from "@effect/vitest"
import * as Either from "effect/Either"
import * as FastCheck from "effect/FastCheck"
import * as Schema from "effect/Schema"
import * as Cursor from "../src/Cursor.js"

const arbCursor = FastCheck.record({
  generation: FastCheck.integer({ min: 1, max: 1_000 }),
  sequence: FastCheck.integer({ min: 0, max: 1_000_000 })
})

describe("Cursor", () => {
  it("orders by generation, then by sequence", () => {
    assert.isTrue(Cursor.isAfter(Cursor.make(2, 0), Cursor.make(1, 999)))
    assert.isTrue(Cursor.isAfter(Cursor.make(1, 5), Cursor.make(1, 4)))
    assert.isFalse(Cursor.isAfter(Cursor.make(1, 4), Cursor.make(1, 4)))
    assert.isTrue(Cursor.isBefore(Cursor.make(1, 4), Cursor.make(3, 0)))
    assert.strictEqual(Cursor.compare(Cursor.make(3, 1), Cursor.make(3, 1)), 0)
    assert.deepStrictEqual(Cursor.max(Cursor.make(1, 9), Cursor.make(2, 0)), Cursor.make(2, 0))
  })

  it("next stays in the generation, nextGeneration starts at sequence 0", () => {
    assert.deepStrictEqual(Cursor.next(Cursor.make(3, 7)), Cursor.make(3, 8))
    assert.deepStrictEqual(Cursor.nextGeneration(Cursor.make(3, 7)), Cursor.make(4, 0))
    assert.deepStrictEqual(Cursor.initial, Cursor.make(1, 0))
    assert.strictEqual(Cursor.format(Cursor.make(2, 5)), "2:5")
  })

  it.prop("next is always after, and the order is total and antisymmetric", [arbCursor, arbCursor], ([a, b]) => {
    assert.isTrue(Cursor.isAfter(Cursor.next(a), a))
    assert.isTrue(Cursor.isAfter(Cursor.nextGeneration(a), Cursor.next(a)))
    assert.strictEqual(Cursor.compare(a, b), -Cursor.compare(b, a) as -1 | 0 | 1)
    assert.strictEqual(Cursor.compare(a, b) === 0, Cursor.equals(a, b))
  })

  it("the schema rejects generation 0, negative or fractional sequences, and missing fields", () => {
    const decode = Schema.decodeUnknownEither(Cursor.Cursor)
    assert.isTrue(Either.isRight(decode({ generation: 1, sequence: 0 })))
    assert.isTrue(Either.isLeft(decode({ generation: 0, sequence: 0 })))
    assert.isTrue(Either.isLeft(decode({ generation: 1, sequence: -1 })))
    assert.isTrue(Either.isLeft(decode({ generation: 1, sequence: 1.5 })))
    assert.isTrue(Either.isLeft(decode({ generation: "1", sequence: 0 })))
    assert.isTrue(Either.isLeft(decode({ generation: 1 })))
  })
})
