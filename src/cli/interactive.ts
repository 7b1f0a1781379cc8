/**
 * The input line of an interactive `agentd attach` (on a terminal, without --read-only or
 * --json): the session's output above, one input line below it.
 *
 * Tidiness: the session's output is written only while the input line is off the screen. The
 * line is shown when the session is idle and the output stands at the start of a line; during a
 * turn it is hidden, and what is typed meanwhile is kept (readline's buffer, not echoed: its
 * echo goes through a gate that is shut while the line is hidden) and shown again with the line
 * at the turn's end. So streamed text is never cut by the input, nor the input by it.
 */
import * as readline from "node:readline"
import { Writable } from "node:stream"

/** What the input line reports. */
export interface InputHandlers {
  /** Enter, with the line typed (the screen hides the line until `done` settles). */
  readonly line: (text: string) => Promise<void>
  /** Ctrl-C. */
  readonly interrupt: () => void
  /** Ctrl-D on an empty line (or the terminal went away). */
  readonly end: () => void
}

export const PROMPT = "> "

export class Screen {
  private promptShown = false
  private atLineStart = true
  private busy = false
  /** A line sent and not answered yet: the input line waits for it. */
  private waiting = false
  private closed = false
  private readonly rl: readline.Interface

  constructor(
    private readonly stdout: NodeJS.WriteStream,
    private readonly stderr: NodeJS.WriteStream,
    stdin: NodeJS.ReadStream,
    handlers: InputHandlers
  ) {
    const self = this
    // readline's own writes (echo, redraws) reach the terminal only while the line is shown.
    const gate = new Writable({
      write(chunk, _encoding, callback) {
        if (self.promptShown) stdout.write(chunk)
        callback()
      }
    })
    Object.defineProperty(gate, "columns", { get: () => stdout.columns })
    Object.defineProperty(gate, "isTTY", { value: true })
    this.rl = readline.createInterface({ input: stdin, output: gate, terminal: true, prompt: PROMPT, historySize: 100 })
    this.rl.on("line", (text) => {
      // readline has ended the typed line: take it off the screen (the session shows a prompt
      // it accepted as its user message).
      if (this.promptShown) {
        const rows = Math.max(1, Math.ceil((PROMPT.length + text.length) / Math.max(1, stdout.columns ?? 80)))
        stdout.write(`\x1b[${rows}A\r\x1b[J`)
        this.promptShown = false
      }
      this.atLineStart = true
      this.waiting = true
      void handlers.line(text).finally(() => {
        this.waiting = false
        this.show()
      })
    })
    this.rl.on("SIGINT", () => handlers.interrupt())
    this.rl.on("close", () => {
      if (!this.closed) {
        this.closed = true
        handlers.end()
      }
    })
  }

  /** Writes the session's output (stdout) or a notice (stderr) above the input line. */
  write(s: string, to: "out" | "err" = "out"): void {
    if (s.length === 0) return
    this.hide()
    if (to === "err" && !this.atLineStart) {
      this.stdout.write("\n")
      this.atLineStart = true
    }
    ;(to === "out" ? this.stdout : this.stderr).write(s)
    this.atLineStart = s.endsWith("\n")
    this.show()
  }

  /** Whether a turn is running (the input line is hidden meanwhile). */
  setBusy(busy: boolean): void {
    this.busy = busy
    if (busy) this.hide()
    else this.show()
  }

  get isBusy(): boolean {
    return this.busy
  }

  /** Takes the input line off the screen for good and gives the terminal back. */
  close(): void {
    this.hide()
    this.closed = true
    this.rl.close()
  }

  private hide(): void {
    if (!this.promptShown) return
    // Up to the row of the input line's first character (the cursor may stand in a wrapped row).
    const columns = Math.max(1, this.stdout.columns ?? 80)
    const rows = Math.floor((PROMPT.length + this.rl.cursor) / columns)
    this.stdout.write(`${rows > 0 ? `\x1b[${rows}A` : ""}\r\x1b[J`)
    this.promptShown = false
  }

  private show(): void {
    if (this.promptShown || this.closed || this.busy || this.waiting || !this.atLineStart) return
    this.promptShown = true
    this.rl.prompt(true)
  }
}
