import { describe, expect, it } from "vitest"
import { webBaseUrl } from "../src/cli/web.js"

describe("agentd web: the address it logs in at", () => {
  it("takes what `serve --http` takes, and URLs", () => {
    expect(webBaseUrl("127.0.0.1:7433")).toBe("http://127.0.0.1:7433")
    expect(webBaseUrl(":7433")).toBe("http://127.0.0.1:7433")
    expect(webBaseUrl("7433")).toBe("http://127.0.0.1:7433")
    expect(webBaseUrl("[::1]:7433")).toBe("http://[::1]:7433")
    expect(webBaseUrl("localhost:80")).toBe("http://localhost:80")
    // A wildcard bind is reached on loopback.
    expect(webBaseUrl("0.0.0.0:7433")).toBe("http://127.0.0.1:7433")
    expect(webBaseUrl("[::]:7433")).toBe("http://[::1]:7433")
    expect(webBaseUrl("https://agents.example.org/")).toBe("https://agents.example.org")
  })

  it("refuses what is not an address", () => {
    for (const bad of ["", "host", "host:", "host:99999", "host:0", "a:b:7433", "[::1", "ftp://x"]) expect(webBaseUrl(bad), bad).toBeUndefined()
  })
})
