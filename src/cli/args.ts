/**
 * The command line's grammar: every command, argument and option described once, a parser
 * that accepts options in any order (before or after the arguments, `--name value` or
 * `--name=value`, `--` ending the options), and the help rendered from the same description.
 *
 * Hand-written rather than @effect/cli: a CLI command is a short-lived process and that
 * library cost ~40 ms of start-up on its own (measured with a code-cached bundle), always
 * coloured its help, printed `$ serve` for `agentd serve`, had no `help` command and refused
 * options it did not expect at one position. This module has no dependency at all.
 */

/** One option of a command. */
export interface OptionSpec {
  readonly name: string
  /** A one-letter alias (`-f`). */
  readonly short?: string
  /** `flag`: present or not; `string`/`integer`: takes a value. */
  readonly kind: "flag" | "string" | "integer"
  /** The value's placeholder in help (`DIR`). */
  readonly value?: string
  /** A `string` option that may be given several times: its values are kept in order, as an array. */
  readonly repeatable?: boolean
  /** The accepted values, if the set is closed. */
  readonly choices?: ReadonlyArray<string>
  /** An `integer` option's least value (default 0). */
  readonly min?: number
  /** What is wrong with a `string` option's value (undefined: nothing), judged at parse time. */
  readonly check?: (value: string) => string | undefined
  readonly description: string
}

/** One positional argument. */
export interface ArgSpec {
  readonly name: string
  readonly description: string
  readonly optional?: boolean
}

/** One command. */
export interface CommandSpec {
  readonly name: string
  /** One line, for the command list. */
  readonly summary: string
  /** More, for `agentd help COMMAND` (paragraphs separated by blank lines). */
  readonly details?: string
  readonly args: ReadonlyArray<ArgSpec>
  readonly options: ReadonlyArray<OptionSpec>
  readonly examples?: ReadonlyArray<string>
}

/** A parsed command line. */
export interface Parsed {
  readonly command: CommandSpec
  readonly args: ReadonlyArray<string>
  readonly options: ReadonlyMap<string, string | number | boolean | ReadonlyArray<string>>
}

/** What the parser asks the program to do. */
export type ParseResult =
  | { readonly _tag: "Run"; readonly parsed: Parsed }
  | { readonly _tag: "Help"; readonly command: CommandSpec | undefined }
  | { readonly _tag: "Version" }
  | { readonly _tag: "UsageError"; readonly message: string; readonly command: CommandSpec | undefined }

const usageError = (message: string, command?: CommandSpec): ParseResult => ({ _tag: "UsageError", message, command })

const closest = (word: string, candidates: ReadonlyArray<string>): string | undefined => {
  const distance = (a: string, b: string): number => {
    const row = Array.from({ length: b.length + 1 }, (_, i) => i)
    for (let i = 1; i <= a.length; i++) {
      let previous = row[0]!
      row[0] = i
      for (let j = 1; j <= b.length; j++) {
        const current = row[j]!
        row[j] = Math.min(row[j]! + 1, row[j - 1]! + 1, previous + (a[i - 1] === b[j - 1] ? 0 : 1))
        previous = current
      }
    }
    return row[b.length]!
  }
  let best: string | undefined
  let bestDistance = 3
  for (const c of candidates) {
    const d = distance(word, c)
    if (d < bestDistance) {
      best = c
      bestDistance = d
    }
  }
  return best
}

/**
 * Parses `argv` (without `node` and the script). The command is the first word that is not an
 * option; options of the command may come before it too (`agentd --socket S status`).
 */
export const parse = (commands: ReadonlyArray<CommandSpec>, argv: ReadonlyArray<string>): ParseResult => {
  const byName = new Map(commands.map((c) => [c.name, c]))
  // The command: the first word that is not an option or an option's value.
  const allOptions = new Map<string, OptionSpec>()
  for (const c of commands) for (const o of c.options) allOptions.set(o.name, o)
  let commandIndex = -1
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i]!
    if (a === "--") break
    if (a.startsWith("--") && !a.includes("=")) {
      const o = allOptions.get(a.slice(2))
      if (o !== undefined && o.kind !== "flag") i++
      continue
    }
    if (a.startsWith("-") && a !== "-") continue
    commandIndex = i
    break
  }
  const rest = commandIndex === -1 ? [...argv] : [...argv.slice(0, commandIndex), ...argv.slice(commandIndex + 1)]
  if (commandIndex === -1) {
    if (rest.includes("--version") || rest.includes("-V")) return { _tag: "Version" }
    if (rest.length === 0 || rest.includes("--help") || rest.includes("-h")) return { _tag: "Help", command: undefined }
    return usageError(`no command given (options: ${rest.join(" ")})`)
  }
  const name = argv[commandIndex]!
  if (name === "help") {
    const topic = rest.find((a) => !a.startsWith("-"))
    if (topic === undefined) return { _tag: "Help", command: undefined }
    const command = byName.get(topic)
    if (command === undefined) return usageError(unknownCommand(topic, commands))
    return { _tag: "Help", command }
  }
  const command = byName.get(name)
  if (command === undefined) return usageError(unknownCommand(name, commands))

  const options = new Map<string, string | number | boolean | ReadonlyArray<string>>()
  const args: Array<string> = []
  const byOption = new Map(command.options.map((o) => [o.name, o]))
  const byShort = new Map(command.options.flatMap((o) => (o.short === undefined ? [] : [[o.short, o] as const])))
  let onlyArgs = false
  for (let i = 0; i < rest.length; i++) {
    const a = rest[i]!
    if (onlyArgs || a === "-" || !a.startsWith("-")) {
      args.push(a)
      continue
    }
    if (a === "--") {
      onlyArgs = true
      continue
    }
    if (a === "--help" || a === "-h") return { _tag: "Help", command }
    let option: OptionSpec | undefined
    let inline: string | undefined
    if (a.startsWith("--")) {
      const eq = a.indexOf("=")
      const key = eq === -1 ? a.slice(2) : a.slice(2, eq)
      inline = eq === -1 ? undefined : a.slice(eq + 1)
      option = byOption.get(key)
      if (option === undefined) {
        const guess = closest(key, command.options.map((o) => o.name))
        return usageError(`unknown option --${key} for \`agentd ${command.name}\`${guess === undefined ? "" : ` (did you mean --${guess}?)`}`, command)
      }
    } else {
      option = byShort.get(a.slice(1))
      if (option === undefined) return usageError(`unknown option ${a} for \`agentd ${command.name}\``, command)
    }
    if (option.kind === "flag") {
      if (inline !== undefined) return usageError(`--${option.name} takes no value`, command)
      options.set(option.name, true)
      continue
    }
    const value = inline ?? rest[++i]
    if (value === undefined) return usageError(`--${option.name} needs a value (${option.value ?? "VALUE"})`, command)
    if (option.choices !== undefined && !option.choices.includes(value)) {
      // Worded as the daemon words an unknown engine, whichever refuses it.
      return usageError(`unknown ${option.name} \`${value}\` (known: ${option.choices.join(", ")})`, command)
    }
    if (option.kind === "integer") {
      if (!/^\d+$/.test(value)) return usageError(`--${option.name} takes a whole number (got ${JSON.stringify(value)})`, command)
      if (Number(value) < (option.min ?? 0)) return usageError(`--${option.name} takes a whole number of at least ${option.min} (got ${value})`, command)
      options.set(option.name, Number(value))
    } else if (option.repeatable === true) {
      options.set(option.name, [...((options.get(option.name) as ReadonlyArray<string> | undefined) ?? []), value])
    } else {
      const wrong = option.check?.(value)
      if (wrong !== undefined) return usageError(`--${option.name}: ${wrong}`, command)
      options.set(option.name, value)
    }
  }
  const required = command.args.filter((a) => a.optional !== true).length
  if (args.length < required) {
    const missing = command.args.slice(args.length).filter((a) => a.optional !== true).map((a) => a.name)
    return usageError(`missing ${missing.join(" and ")}`, command)
  }
  if (args.length > command.args.length) {
    return usageError(`unexpected argument ${JSON.stringify(args[command.args.length])}`, command)
  }
  return { _tag: "Run", parsed: { command, args, options } }
}

const unknownCommand = (name: string, commands: ReadonlyArray<CommandSpec>): string => {
  const guess = closest(name, commands.map((c) => c.name))
  return `unknown command ${JSON.stringify(name)}${guess === undefined ? "" : ` (did you mean \`agentd ${guess}\`?)`}`
}

// ---------------------------------------------------------------------------------------------
// Help
// ---------------------------------------------------------------------------------------------

/** Whether to colour output written to `stream`: a terminal, and `NO_COLOR` not set. */
export const useColor = (stream: { readonly isTTY?: boolean }, env: NodeJS.ProcessEnv = process.env): boolean =>
  stream.isTTY === true && (env["NO_COLOR"] === undefined || env["NO_COLOR"] === "") && env["TERM"] !== "dumb"

const bold = (color: boolean, s: string) => (color ? `\x1b[1m${s}\x1b[22m` : s)

const wrap = (text: string, width: number, indent: number): string => {
  const words = text.split(/\s+/).filter((w) => w.length > 0)
  const lines: Array<string> = []
  let line = ""
  for (const w of words) {
    if (line.length > 0 && indent + line.length + 1 + w.length > width) {
      lines.push(line)
      line = w
    } else {
      line = line.length === 0 ? w : `${line} ${w}`
    }
  }
  if (line.length > 0) lines.push(line)
  return lines.join(`\n${" ".repeat(indent)}`)
}

const argUsage = (a: ArgSpec) => (a.optional === true ? `[${a.name}]` : a.name)

/** The usage line of a command. */
export const usageLine = (command: CommandSpec): string =>
  ["agentd", command.name, ...(command.options.length > 0 ? ["[options]"] : []), ...command.args.map(argUsage)].join(" ")

const table = (rows: ReadonlyArray<readonly [string, string]>, color: boolean, width: number): string => {
  const left = Math.min(28, Math.max(...rows.map(([l]) => l.length)) + 2)
  return rows.map(([l, r]) => {
    const pad = l.length + 2 > left ? `\n${" ".repeat(left + 2)}` : " ".repeat(left - l.length)
    return `  ${bold(color, l)}${pad}${wrap(r, width, left + 2)}`
  }).join("\n")
}

/** `agentd help COMMAND`. */
export const commandHelp = (command: CommandSpec, color: boolean, width = 100): string => {
  const out: Array<string> = [`${bold(color, "Usage:")} ${usageLine(command)}`, "", wrap(command.summary, width, 0)]
  if (command.details !== undefined) {
    for (const p of command.details.split(/\n\s*\n/)) out.push("", wrap(p, width, 0))
  }
  if (command.args.length > 0) {
    out.push("", bold(color, "Arguments:"), table(command.args.map((a) => [a.name, a.description]), color, width))
  }
  const options = [...command.options, { name: "help", short: "h", kind: "flag", description: "Show this help." } as OptionSpec]
  out.push(
    "",
    bold(color, "Options:"),
    table(
      options.map((o) => {
        const names = `${o.short === undefined ? "" : `-${o.short}, `}--${o.name}${o.kind === "flag" ? "" : ` ${o.value ?? "VALUE"}`}`
        const choices = o.choices === undefined ? "" : ` One of: ${o.choices.join(", ")}.`
        return [names, o.description + choices]
      }),
      color,
      width
    )
  )
  if (command.examples !== undefined && command.examples.length > 0) {
    out.push("", bold(color, "Examples:"), ...command.examples.map((e) => `  $ ${e}`))
  }
  return out.join("\n") + "\n"
}

/** `agentd help`. */
export const mainHelp = (commands: ReadonlyArray<CommandSpec>, color: boolean, epilogue: string, width = 100): string =>
  [
    `${bold(color, "Usage:")} agentd COMMAND [options] [arguments]`,
    "",
    "agentd hosts long-running AI agent sessions in supervised worker processes; clients attach, detach and resume over a Unix socket.",
    "",
    bold(color, "Commands:"),
    table(commands.map((c) => [c.name, c.summary]), color, width),
    "",
    epilogue
  ].join("\n") + "\n"
