/**
 * A network namespace joined to this machine by a veth pair on a private /30, for tests that
 * cut a host off by taking a link down (the partition tests). Needs root and `ip` (iproute2).
 * Names are unique per run; `destroy` removes the pair and the namespace, and is safe to call
 * twice or after a failed setup. Traffic stays on this machine: both ends are ours.
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"

const ip = (...args: Array<string>): { ok: boolean; out: string } => {
  const r = spawnSync("ip", args, { encoding: "utf8" })
  return { ok: r.status === 0, out: `${r.stdout ?? ""}${r.stderr ?? ""}${r.error === undefined ? "" : String(r.error)}` }
}

/** Why namespaces cannot be made here, or undefined when they can. */
export const netnsUnavailable = (): string | undefined => {
  if (process.getuid?.() !== 0) return "network namespaces need root"
  const probe = `agp${process.pid % 100000}x`
  const added = ip("netns", "add", probe)
  if (!added.ok) return `\`ip netns add\` failed: ${added.out.trim()}`
  ip("netns", "del", probe)
  return undefined
}

export class NetNs {
  readonly hostIf: string
  readonly nsIf: string
  readonly hostIp: string
  readonly nsIp: string
  /** The /30 of both ends. */
  readonly cidr: string
  private made: Array<() => void> = []

  constructor(readonly name: string, subnet: { readonly a: number; readonly b: number }) {
    // Interface names are at most 15 bytes.
    const tag = name.slice(-10)
    this.hostIf = `h${tag}`
    this.nsIf = `n${tag}`
    this.hostIp = `10.231.${subnet.a}.${subnet.b + 1}`
    this.nsIp = `10.231.${subnet.a}.${subnet.b + 2}`
    this.cidr = `10.231.${subnet.a}.${subnet.b}/30`
  }

  /** A namespace with a unique name and a /30 of 10.231.0.0/16 no interface of this machine uses. */
  static create(): NetNs {
    const used = ip("-4", "addr").out
    for (let attempt = 0; attempt < 50; attempt++) {
      const a = Math.floor(Math.random() * 256)
      const b = Math.floor(Math.random() * 64) * 4
      if (used.includes(`10.231.${a}.${b + 1}/`) || used.includes(`10.231.${a}.${b + 2}/`)) continue
      const ns = new NetNs(`ag${process.pid % 100000}${Date.now().toString(36).slice(-4)}${attempt}`, { a, b })
      ns.setUp()
      return ns
    }
    throw new Error("no free /30 in 10.231.0.0/16")
  }

  private run(...args: Array<string>): void {
    const r = ip(...args)
    if (!r.ok) throw new Error(`ip ${args.join(" ")}: ${r.out.trim()}`)
  }

  private setUp(): void {
    try {
      this.run("netns", "add", this.name)
      this.made.push(() => ip("netns", "del", this.name))
      this.run("link", "add", this.hostIf, "type", "veth", "peer", "name", this.nsIf)
      this.made.push(() => ip("link", "del", this.hostIf))
      this.run("link", "set", this.nsIf, "netns", this.name)
      this.run("addr", "add", `${this.hostIp}/30`, "dev", this.hostIf)
      this.run("link", "set", this.hostIf, "up")
      this.run("netns", "exec", this.name, "ip", "addr", "add", `${this.nsIp}/30`, "dev", this.nsIf)
      this.run("netns", "exec", this.name, "ip", "link", "set", this.nsIf, "up")
      this.run("netns", "exec", this.name, "ip", "link", "set", "lo", "up")
    } catch (e) {
      this.destroy()
      throw e
    }
  }

  /** Takes the host's end of the link down: nothing passes either way (packets are dropped, no reset). */
  cut(): void {
    this.run("link", "set", this.hostIf, "down")
  }

  restore(): void {
    this.run("link", "set", this.hostIf, "up")
  }

  /** Whether the namespace still exists (for the clean-up check). */
  exists(): boolean {
    return fs.existsSync(`/run/netns/${this.name}`)
  }

  destroy(): void {
    for (const undo of this.made.splice(0).reverse()) undo()
  }
}
