/** The daemon's JSON commands under /v1 (docs/protocol.md section 10), with the login cookie. */

/** An error answer of the HTTP front: its status, code, message and request id. */
export class ApiError extends Error {
  constructor(readonly status: number, readonly code: string, message: string, readonly requestId: string | undefined) {
    super(message)
  }

  static async of(res: Response): Promise<ApiError> {
    let code = "http_error"
    let message = `${res.status} ${res.statusText}`
    let requestId = res.headers.get("x-request-id") ?? undefined
    try {
      const body = (await res.json()) as { error?: { code?: string; message?: string; requestId?: string } }
      if (body.error !== undefined) {
        code = body.error.code ?? code
        message = body.error.message ?? message
        requestId = body.error.requestId ?? requestId
      }
    } catch {
      // not JSON: the status says it
    }
    return new ApiError(res.status, code, message, requestId)
  }

  /** For a person: the message, with the request id to quote in a report. */
  describe(): string {
    return `${this.message}${this.requestId === undefined ? "" : ` (request ${this.requestId})`}`
  }
}

/** One command; its `data`, or an {@link ApiError}. */
export const api = async <A>(method: string, path: string, body?: unknown): Promise<A> => {
  const res = await fetch(path, {
    method,
    credentials: "same-origin",
    headers: body === undefined ? {} : { "content-type": "application/json" },
    ...(body === undefined ? {} : { body: JSON.stringify(body) })
  })
  if (!res.ok) throw await ApiError.of(res)
  return (await res.json()) as A
}

/** A readable text for any error. */
export const describeError = (e: unknown): string =>
  e instanceof ApiError ? e.describe() : e instanceof Error ? e.message : String(e)
