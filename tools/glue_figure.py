"""Sphinx extension (loaded by _config.yml): `{glue:figure}` with a `:doc:` option.

A chapter page shows its notebook's key figures, glued there (`labs.measure.report.glue`), so
the picture on the page is the one the lab measured. myst-nb 1.4 pastes an output of another
document only through `{glue}` and `{glue:text}`; its `{glue:figure}` reads the page's own
notebook, and a chapter is a Markdown page. This directive is myst-nb's `{glue:figure}` plus
`:doc:` (the notebook, relative to the page):

    ```{glue:figure} sched_gpipe
    :doc: ../notebooks/05_pipeline_parallel.ipynb
    :name: fig-gpipe

    GPipe at p = 4, m = 8, as the executor ran it.
    ```

It wraps myst-nb's cross-document reference in a figure with the caption; myst-nb's own
post-transform later puts the image in its place. That image is the PNG the notebook page
shows (same bytes, same file name), so a figure is glued displayed, never hidden.
"""
from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.transforms.post_transforms import SphinxPostTransform
from myst_nb.ext.glue.directives import PasteFigureDirective
from myst_nb.ext.glue.utils import PendingGlueReferenceError, create_pending_glue_ref, glue_warning


class PasteFigureFromDoc(PasteFigureDirective):
    """myst-nb's `{glue:figure}`; with `:doc:`, the glued figure of that notebook."""

    option_spec = {**PasteFigureDirective.option_spec, "doc": directives.unchanged_required}

    def run(self):
        if "doc" not in self.options:
            return super().run()
        unsupported = sorted({"alt", "height", "width", "scale", "class"} & set(self.options))
        if unsupported:  # the image is made after parsing, where these cannot be applied
            return [glue_warning(f"glue:figure with :doc: takes no {', '.join(unsupported)} option",
                                 self.document, self.line)]
        try:
            ref = create_pending_glue_ref(self.document, self.source, self.line, self.options["doc"],
                                          self.arguments[0], gtype="any")
        except PendingGlueReferenceError as exc:
            return [glue_warning(str(exc), self.document, self.line)]
        figure = nodes.figure("", ref, glued=True)
        self.set_source_info(figure)
        if self.options.get("figwidth") is not None:
            figure["width"] = self.options["figwidth"]
        figure["classes"] += self.options.get("figclass", [])
        if self.options.get("align"):
            figure["align"] = self.options["align"]
        self.add_name(figure)
        if self.content:
            body = nodes.Element()
            self.state.nested_parse(self.content, self.content_offset, body)
            first = body[0]
            if not isinstance(first, nodes.paragraph):
                return [glue_warning("glue:figure caption must be a paragraph", self.document, self.line)]
            caption = nodes.caption(first.rawsource, "", *first.children)
            caption.source, caption.line = first.source, first.line
            figure += caption
            if len(body) > 1:
                figure += nodes.legend("", *body[1:])
        return [figure]


class CaptionAsAlt(SphinxPostTransform):
    """After myst-nb has put the image in (its priority is 5): the caption is the image's alt text,
    not its file name."""

    default_priority = 6

    def run(self, **kwargs):
        for figure in self.document.findall(nodes.figure):
            if not figure.get("glued"):
                continue
            captions = [c.astext() for c in figure.findall(nodes.caption)]
            for image in figure.findall(nodes.image):
                if captions and not image.get("alt"):
                    image["alt"] = captions[0]


def setup(app):
    app.setup_extension("myst_nb")
    app.add_directive_to_domain("glue", "figure", PasteFigureFromDoc, override=True)
    app.add_post_transform(CaptionAsAlt)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
