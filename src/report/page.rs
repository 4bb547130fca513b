//! The HTML of kvx's pages: escaping, comfy tables as HTML tables, figures (inline SVG under
//! the question they answer), the style and the document ([`Page`]); also the questions the
//! run charts answer. A leaf: the pages (`html`, `pages`) are built with it.
//!
//! Self-contained by construction: no script, no stylesheet, font or image from elsewhere; void
//! elements closed and text escaped, so the page is also well-formed XML.

use comfy_table::Table;

/// Text escaped for HTML element content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A comfy table as an HTML table (its header row as `th`).
pub fn table_html(t: &Table) -> String {
    let mut out = String::from("<table>\n");
    if let Some(h) = t.header() {
        out.push_str("<thead><tr>");
        for c in h.cell_iter() {
            out.push_str(&format!("<th>{}</th>", escape(&c.content())));
        }
        out.push_str("</tr></thead>\n");
    }
    out.push_str("<tbody>\n");
    for r in t.row_iter() {
        out.push_str("<tr>");
        for c in r.cell_iter() {
            out.push_str(&format!("<td>{}</td>", escape(&c.content())));
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody>\n</table>\n");
    out
}

/// An SVG chart made fit to sit inline: the XML declaration (if any) dropped.
fn inline_svg(svg: &str) -> &str {
    match svg.find("<svg") {
        Some(i) => &svg[i..],
        None => svg,
    }
}

const STYLE: &str = "body{font-family:sans-serif;max-width:1000px;margin:1em auto;padding:0 1em;color:#222}\
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;margin-top:1.6em}\
table{border-collapse:collapse;margin:.5em 0;font-size:.85em}\
th,td{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}\
td{font-variant-numeric:tabular-nums}th{background:#f3f3f3}\
figure{margin:1em 0}figcaption{font-size:.9em;color:#444;margin-bottom:.3em}\
svg{max-width:100%;height:auto}.none{color:#666;font-style:italic}.warn{color:#a00;font-weight:bold}code{font-size:.85em}\
@media print{body{max-width:none}figure,table{page-break-inside:avoid}h2{page-break-after:avoid}}";

/// A page's parts, in order; [`Page::finish`] makes the document.
#[derive(Debug, Default)]
pub(crate) struct Page {
    pub(crate) body: String,
}

impl Page {
    pub(crate) fn h1(&mut self, title: &str) {
        self.body.push_str(&format!("<h1>{}</h1>\n", escape(title)));
    }

    pub(crate) fn h2(&mut self, title: &str) {
        self.body.push_str(&format!("<h2>{}</h2>\n", escape(title)));
    }

    pub(crate) fn p(&mut self, text: &str) {
        self.body.push_str(&format!("<p>{}</p>\n", escape(text)));
    }

    /// A line in bold red: a warning, a regression.
    pub(crate) fn warn(&mut self, text: &str) {
        self.body.push_str(&format!("<p class=\"warn\">{}</p>\n", escape(text)));
    }

    pub(crate) fn table(&mut self, title: &str, t: &Table) {
        self.body.push_str(&format!("<h3>{}</h3>\n", escape(title)));
        self.body.push_str(&table_html(t));
    }

    /// The whole document, titled.
    pub(crate) fn finish(self, title: &str) -> String {
        format!(
            "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n\
             <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>\n\
             <title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{}</body>\n</html>\n",
            escape(title),
            self.body
        )
    }

    /// A chart under the question it answers, or a line saying the run has nothing to draw.
    pub(crate) fn figure(&mut self, id: &str, question: &str, svg: Option<String>) {
        match svg {
            Some(svg) => self.body.push_str(&format!(
                "<figure id=\"{}\">\n<figcaption>{}</figcaption>\n{}\n</figure>\n",
                escape(id),
                escape(question),
                inline_svg(&svg)
            )),
            None => self.body.push_str(&format!(
                "<p class=\"none\">No chart for &#8220;{}&#8221;: the run has no data for it (no request \
                 ended ok, or its files predate what the chart needs).</p>\n",
                escape(question.split('?').next().unwrap_or(question))
            )),
        }
    }
}

/// The questions the charts answer, as the page (and docs/report.md) words them.
pub const WATERFALL_QUESTION: &str = "Where does one request spend its time? The median and the p99 request by end-to-end latency, \
     each stage a bar on the request's own timeline, each decode rank's reads a lane of their own; \
     verification is outside the timed path and shown apart.";
pub const LATENCY_QUESTION: &str = "How are end-to-end and transfer latencies distributed? Each line rises at every request; \
     stages that coincide are drawn once.";
pub const RANK_QUESTION: &str = "Does one decode rank read slower than the others? Each rank's own bandwidth per request \
     (box: middle half; bar: median; dots: requests), beside the request's bandwidth over its wall span.";
pub const TIME_QUESTION: &str = "Was the run steady? Completions and bandwidth in buckets sized to the run, with the warm-up, \
     injected faults and lease expiries marked.";

/// A page as a browser reads it (HTML5 parsing): no parse error, under 2 MB, one title,
/// nothing loaded from elsewhere (no script, no element that loads, no `src`/`href`, no CSS
/// `url(` or `@import`), every figure's chart inline. Returns the page's outline: its
/// headings and figure ids, one a line.
#[cfg(test)]
pub(crate) fn check_page(html: &str) -> String {
    use scraper::{Html, Selector};
    let sel = |s: &str| Selector::parse(s).expect("selector");
    assert!(html.len() < 2_000_000, "the page is {} bytes", html.len());
    let doc = Html::parse_document(html);
    assert!(doc.errors.is_empty(), "HTML parse errors: {:?}", doc.errors);
    for e in doc.select(&sel("*")) {
        let tag = e.value().name();
        assert!(
            !["script", "link", "img", "iframe", "object", "embed", "image", "use", "foreignobject"]
                .contains(&tag.to_ascii_lowercase().as_str()),
            "<{tag}> in the page"
        );
        for (name, value) in e.value().attrs() {
            assert!(
                !["src", "href", "xlink:href", "srcset", "action", "poster", "data"].contains(&name),
                "{name}={value} on <{tag}>"
            );
            assert!(!value.contains("url("), "url( in {name} on <{tag}>");
        }
    }
    for style in doc.select(&sel("style")) {
        let css: String = style.text().collect();
        assert!(!css.contains("url(") && !css.contains("@import"), "CSS from elsewhere");
    }
    assert_eq!(doc.select(&sel("h1")).count(), 1, "one title");
    let mut outline = Vec::new();
    for e in doc.select(&sel("h1, h2, h3, figure")) {
        let tag = e.value().name();
        if tag == "figure" {
            assert!(e.select(&sel("svg")).next().is_some(), "a figure without its chart inline");
            outline.push(format!("  figure #{}", e.value().attr("id").unwrap_or_default()));
        } else {
            let text: Vec<&str> = e.text().flat_map(str::split_whitespace).collect();
            outline.push(format!("{tag}: {}", text.join(" ")));
        }
    }
    outline.join("\n")
}
